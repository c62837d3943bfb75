"""A loss spike the weights do not heal from (guard/spike.py): the rollback to the newest
checkpoint known healthy, recorded before anything else changes, and applied the same way by the
run that decides it and by any restart that comes before its next checkpoint.

    decide the target (spike.target) -> record it (store.record_rollback: the checkpoints
    after the target are superseded in one durable write) -> move those aside (rollback-<time>/)
    -> rebuild the trainer from the target as a restart would -> apply the record (apply_rollback:
    the loader past the batches read since, the run's rollbacks and its lower lr)

A restart between the record and the next checkpoint finds the record (run/resume.py) and goes
on from the target with the same rollback applied, at any W.
"""

from __future__ import annotations

import dataclasses
import gc
from pathlib import Path

from ddpgpt.checkpoint import store
from ddpgpt.distributed import collectives
from ddpgpt.errors import warn
from ddpgpt.guard.spike import Verdict, json_number, target
from ddpgpt.run import resume
from ddpgpt.run.metrics import Metrics
from ddpgpt.run.run_dir import RunDir


def roll_back(trainer, verdict: Verdict, run_dir: RunDir, origin: resume.Start,
              metrics: Metrics, build):
    """The trainer that goes on after a spike the weights did not heal from: rebuilt by
    `build(start)` (setup: the same path as a restart) from the newest healthy checkpoint
    (spike.target), the loader moved past the batches read since, the lr lowered for the rest of
    the run. The decision is recorded first (store.record_rollback: the checkpoints after the
    target are superseded at once, and a restart from here on applies the same rollback), then
    those checkpoints are moved aside. Collective: every rank decides the same and calls it."""
    cfg, guard, env, spike = trainer.cfg.run, trainer.guard, trainer.env, verdict.spike
    spikes = guard.spikes
    found = _healthy_start(run_dir, verdict.first, origin, spikes)
    what = spike.describe(cfg.spike_ratio, len(spikes.losses))  # the window it was judged by
    record = {"to": found.step, "checkpoint": _target_name(run_dir, found.path),
              "rollbacks": len(spikes.rollbacks) + 1, "spike_step": spike.step,
              "first_step": verdict.first, "read": trainer.loader.batch_index,
              "before": [dict(r) for r in spikes.rollbacks], "lr_factor": spikes.lr_factor,
              "trouble": spikes.trouble}  # the level the rolled-back run must get back to
    trainer.doing = f"the rollback after step {spike.step}"
    aside = collectives.together(env, lambda: _record(run_dir, record), main_only=True)
    trainer.close()  # the old model and optimizer go before the new ones are built
    gc.collect()
    guard.load_state_dict(None)  # a start from scratch loads nothing into it
    new = build(found)
    batches, skipped = apply_rollback(new, record)
    name = found.path.name if found.path else "the initial state"
    steps = f" (steps {found.step + 1}-{spike.step})" * (batches == spike.step - found.step)
    since = "" if verdict.first == spike.step else f" (the spike began at step {verdict.first})"
    moved = f"; the later checkpoints are in {aside}" if aside else ""
    metrics.write(f"ddpgpt: warning: step {spike.step}: {what}{since}; rolling back to step "
                  f"{found.step} ({name}), skipping the {batches} global batch"
                  f"{'es' if batches > 1 else ''} read after it{steps}, the lr × "
                  f"{spikes.lr_factor:g} from now on (rollback {spikes.recent(spike.step)} of at "
                  f"most {cfg.max_rollbacks} within {cfg.rollback_window} steps){moved}")
    metrics.rewind(new.step)
    metrics.log_event(new.step, "rollback", **spike_fields(verdict),
                      checkpoint=str(found.path) if found.path else None,
                      checkpoint_step=found.step, skipped_batches=batches,
                      skipped_windows=skipped, lr_factor=spikes.lr_factor,
                      rollbacks=len(spikes.rollbacks))
    collectives.barrier(env)  # every rank has rolled back before any trains on
    return new


def apply_rollback(trainer, record: dict) -> tuple[int, list[dict]]:
    """A recorded rollback (roll_back's `record`) on a trainer just built from its target: the
    run's rollbacks, lr factor and trouble (the level it must get back to: spike.py) as they
    were at the spike, with this one added, and the loader moved past the global batches read
    since the target's cursor (those of steps to+1..spike, and any an earlier rollback to the
    same checkpoint skipped on the way). The same on every
    rank and at any W. Returns (the batches skipped, their windows: loader.skip)."""
    spikes = trainer.guard.spikes
    spikes.rollbacks = [dict(r) for r in record["before"]]
    spikes.lr_factor = float(record["lr_factor"])
    if record.get("trouble"):  # absent in records from before the end's verdict
        spikes.trouble = dict(record["trouble"])
    batches = int(record["read"]) - trainer.loader.batch_index
    skipped = trainer.loader.skip(batches)
    spikes.rolled_back(int(record["spike_step"]), int(record["to"]), batches)
    return batches, skipped


def _record(run_dir: RunDir, record: dict) -> Path | None:
    """Rank 0: the rollback on the disk, then the checkpoints it superseded moved aside."""
    store.record_rollback(run_dir.checkpoints, record)
    return resume.set_abandoned_aside(run_dir)


def _target_name(run_dir: RunDir, path: Path | None) -> str | None:
    """A rollback's target as its record names it: its name when it is in the run's checkpoints
    (the run dir may move), else its absolute path (an explicit --resume PATH elsewhere)."""
    if path is None:
        return None
    path = path.resolve()
    return path.name if path.parent == run_dir.checkpoints.resolve() else str(path)


def _healthy_start(run_dir: RunDir, first: int, origin: resume.Start,
                   spikes) -> resume.Start:
    """The checkpoint to roll back to (spike.target: known healthy) as a Start; `origin` (where
    this process started) when no checkpoint of this run qualifies. The starting checkpoint
    itself is `origin`, which knows a data switch."""
    dirs = dict(store.step_dirs(run_dir.checkpoints))
    while (step := target(sorted(dirs), first, origin.step, spikes.rollbacks,
                          spikes.healthy_checkpoints)) is not None:
        if step == origin.step and origin.path:
            return dataclasses.replace(origin, rollback=None, set_aside=[])
        try:
            meta = store.read_meta(dirs[step])
        except store.CheckpointError as e:
            warn(f"rollback: skipping checkpoint {dirs[step].name}: {e}")
            del dirs[step]
            continue
        return resume.Start(dirs[step], meta, origin=meta.get("origin"))
    return dataclasses.replace(origin, rollback=None, set_aside=[])


def spike_fields(verdict: Verdict) -> dict:
    spike = verdict.spike
    if spike is None:
        return {}
    return {"spike_step": spike.step, "spike_loss": json_number(spike.loss),
            "median": json_number(spike.median), "nonfinite_ranks": spike.ranks,
            **({"first_step": verdict.first} if verdict.first else {})}

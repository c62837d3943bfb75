"""Where a run starts: from scratch, from its run dir's newest checkpoint, or from an explicit one.

run.resume (`--resume`, `--reset`) is a rule for the job's first start; every restart (torchrun's
elastic restarts, `--max-restarts`) continues from the run dir's newest complete checkpoint:

    auto    the newest complete checkpoint in the run dir, if there is one; on a first start,
            none where metrics.jsonl shows training is refused: a run dir that has trained
            starts over only with --reset (its checkpoints deleted, lost, or looked for at
            another URL: the line says where they were), or when it stopped before its first
            checkpoint was due (then its metrics are set aside, as --reset sets them, and a
            line says why)
    reset   first start: set the run dir's checkpoints and metrics aside (reset-<time>/), start over
    never   first start: refuse a run dir that has checkpoints (or, as auto, has trained)
    PATH    first start: that checkpoint. If PATH is in the run dir, the checkpoints after it are
            set aside (rewind-<time>/); another run's checkpoints in the run dir are refused.
            Every checkpoint that descends from PATH names it as its `origin`, so a restart or a
            rerun of the same command continues from the newest of those, not from PATH again.

A rollback after a loss spike that no checkpoint has recorded yet (checkpoint/store.py:
record_rollback) is part of where a run starts: the checkpoints it abandoned are skipped, and the
start from its target carries it (`Start.rollback`), so that the rollback is applied again (its
data skip, its lower lr) exactly as the run that decided it applied it (train.py: apply_rollback).

Choosing reads files only, so it runs before any process group exists (`verify=False`: meta.json
only, for fast one-line errors) and again under the run's lock (`verify=True`: every file's hash).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from ddpgpt.checkpoint import location, store, swap
from ddpgpt.checkpoint.read import trained_tokenizer
from ddpgpt.checkpoint.store import CheckpointError
from ddpgpt.config.checks import ConfigError
from ddpgpt.config.io import from_dict
from ddpgpt.config.optim import OptimConfig
from ddpgpt.config.schema import TrainConfig
from ddpgpt.data.shards import TokenDataset
from ddpgpt.errors import UserError
from ddpgpt.guard.health import Unhealthy
from ddpgpt.optim.schedule import extends_flat
from ddpgpt.run.metrics import evaluated_at, trained_to
from ddpgpt.run.run_dir import RunDir

# What a checkpoint's weights are made of: a resume must keep them (the architecture's pieces
# included; logit_softcap, rope_theta, norm_eps and gelu change no weight and may change).
SHAPE_FIELDS = ("n_layer", "n_head", "n_embd", "block_size", "vocab_size", "bias", "rope", "norm",
                "qk_norm", "mlp", "tie_embeddings")
WIDTHS = ("mlp_hidden", "n_kv_head", "head_dim")  # named only when the fields above agree: their
# defaults follow n_embd, n_head and mlp


@dataclass
class Start:
    path: Path | None = None      # the checkpoint to load; None: from scratch
    meta: dict | None = None
    origin: dict | None = None    # {"path", "step"} of the explicit --resume PATH this run
                                  # descends from
    set_aside: list[Path] = field(default_factory=list)  # later checkpoints a rewind moves away
    data_switch: bool = False     # resumed on another dataset, with data.allow_switch
    rollback: dict | None = None  # a recorded rollback to apply on this start (its target's)
    over: str = ""                # why a run dir that trained starts over (its files set aside)

    @property
    def step(self) -> int:
        return int(self.meta["step"]) if self.meta else 0


def plan(cfg: TrainConfig, run_dir: RunDir, dataset: TokenDataset, first_start: bool = True,
         verify: bool = False, quiet: bool = False) -> tuple[TrainConfig, Start]:
    """Where a run starts (`choose`) and the config it trains with from there (`settle`): the
    one call every place that starts a run makes (one process, `--nproc`'s launcher, each worker
    once it holds the run dir, `--print-config`)."""
    start = choose(cfg, run_dir, first_start, dataset.fingerprint, verify=verify,
                   tokenizer=dataset.tokenizer_fingerprint, quiet=quiet)
    return settle(cfg, start, first_start), start


def choose(cfg: TrainConfig, run_dir: RunDir, first_start: bool, fingerprint: str,
           verify: bool = True, tokenizer: str | None = None, quiet: bool = False) -> Start:
    """`fingerprint`: the dataset's (its meta.json's sha256); `tokenizer`: its tokenizer's
    (data.tokenizer.fingerprint), checked when the data differs from the checkpoint's. `quiet`:
    a checkpoint skipped as bad is not announced (every rank chooses, rank 0 says it)."""
    mode = cfg.run.resume
    if mode in ("auto", "reset", "never"):
        existing = store.step_dirs(run_dir.checkpoints)
        if first_start and mode == "reset":
            return Start()  # the caller sets them aside
        if first_start and mode == "never" and existing:
            raise UserError(f"run dir {run_dir} already has checkpoints (up to step "
                            f"{existing[-1][0]}) and run.resume = never; use --resume auto to "
                            "continue, --reset to start over, or another --run-dir")
        found = _latest(run_dir.checkpoints, verify, quiet)
        start = Start(*found, origin=found[1].get("origin")) if found else Start()
    else:
        start = _explicit(run_dir, location.at(mode), first_start, verify)
    start.rollback = _pending(run_dir, start)
    if start.path is not None:
        _check_fit(cfg, start, run_dir, mode, fingerprint, tokenizer)
    elif first_start and mode in ("auto", "never") and start.rollback is None:
        start.over = _keep_trained(run_dir)
    return start


def _keep_trained(run_dir: RunDir) -> str:
    """A first start from scratch in a run dir whose metrics.jsonl shows training: refused in one
    line naming the step it reached, where its checkpoints were (config.json's
    run.checkpoint_url, or checkpoints/) and what is there now. Only --reset starts such a run
    over, but for one that stopped before its first checkpoint was due (a crash, a job killed
    and requeued): there is nothing to continue from, so it starts over with its metrics set
    aside as --reset sets them, and the line returned says why. A run dir another run holds is
    refused as busy (the lock's line) before any of that."""
    reached = trained_to(run_dir.metrics)
    if not reached:
        return ""
    # A run training here now (before its first checkpoint, or between saves) is what the lock
    # says, not a run to reset: its one line (RunDirBusy) comes before any advice to reset.
    run_dir.check_free()
    saved = run_dir.saved_url()
    was, now = location.at(saved) if saved else run_dir.path / "checkpoints", run_dir.checkpoints
    head = f"run dir {run_dir} trained to step {reached} (its metrics.jsonl)"
    refused = "refused to start it over from step 0"
    reset = "or pass --reset to start over (its metrics go to reset-<time>/)"
    if was == now:  # deleted, lost by the store, or none written yet
        due, every = _first_due(run_dir)
        if due is not None and reached < due:
            return (f"{head}, stopped before its first checkpoint was due (step {due}, "
                    f"run.checkpoint_every = {every}), so it starts over from step 0")
        raise UserError(f"{head}, but no checkpoint of it is left: {now} {_there(now)}; "
                        f"{refused}: put its checkpoints back there, {reset}")
    newest, there = _newest(was)
    fix = (f"{was} {there}: put its checkpoints back" if newest is None else
           f"--run.checkpoint-url {was} continues it from step {newest}"
           if location.is_remote(was) else
           f"without --run.checkpoint-url it continues from step {newest} in {was}")
    given = "run.checkpoint_url" if run_dir.remote else "no run.checkpoint_url"
    raise UserError(f"{head} with its checkpoints at {was}, but this start looks for them at "
                    f"{now} ({given}), which {_there(now)}; {refused}: {fix}, {reset}")


def _first_due(run_dir: RunDir) -> tuple[int | None, int]:
    """(the step of the run's first scheduled checkpoint, run.checkpoint_every), as its
    config.json says; (None, 0) when it cannot be read."""
    try:
        run = json.loads(run_dir.config.read_text())["run"]
        every, steps = int(run["checkpoint_every"]), int(run["steps"])
    except (OSError, ValueError, KeyError, TypeError):
        return None, 0
    return (every if 0 < every < steps else steps), every


def _there(root) -> str:
    """What a checkpoint root without a checkpoint to start from is, for a message."""
    return "holds no checkpoint" if location.is_remote(root) or root.exists() \
        else "does not exist"


def _newest(root) -> tuple[int | None, str]:
    """The step of the newest checkpoint at `root` (its meta.json read, no file hashed), or
    None and why, for the line."""
    try:
        found = _latest(root, verify=False, quiet=True)
    except (UserError, OSError) as e:
        return None, f"cannot be read from here ({e})"
    return (int(found[1]["step"]), "") if found else (None, f"{_there(root)} either")


def _pending(run_dir: RunDir, start: Start) -> dict | None:
    """The recorded rollback that `start` goes on with: the one whose target it is (its
    checkpoint, or from scratch for a rollback to the initial state). Any other start leaves it
    behind (the caller clears it: elastic.claim)."""
    record = store.pending_rollback(run_dir.checkpoints) \
        if run_dir.checkpoints.is_dir() else None
    if record is None:
        return None
    target = record.get("checkpoint")  # a name in checkpoints/, or a path outside the run dir
    same = start.path is None if target is None else start.path is not None and \
        (run_dir.checkpoints / target).resolve() == start.path.resolve()
    return record if same else None


def set_abandoned_aside(run_dir: RunDir, start: Start | None = None) -> Path | None:
    """Rank 0, under the run's lock: the checkpoints a recorded rollback superseded go into
    rollback-<time>/ (nothing is deleted; a kill may have come between the record and this).
    `start`: this start, which leaves behind a record it does not go on with (an explicit
    --resume elsewhere). Returns where they went, if anywhere."""
    aside = run_dir.set_aside("rollback", store.superseded(run_dir.checkpoints))
    if start is not None and start.rollback is None:
        (run_dir.checkpoints / store.ROLLBACK).unlink(missing_ok=True)
    return aside


def _latest(root: Path, verify: bool, quiet: bool) -> tuple[Path, dict] | None:
    if verify:
        return store.find_latest(root, quiet)
    for _, path in reversed(store.step_dirs(root)):
        try:
            return path, store.read_meta(path, verify=False)
        except store.CheckpointVersionError:
            raise
        except CheckpointError:
            continue
    return store.find_latest(root, quiet)  # none parses: its error names the newest's problem


def _explicit(run_dir: RunDir, path: Path, first_start: bool, verify: bool) -> Start:
    origin_path = str(path.resolve())
    path = swap.standing(path)  # a step whose re-save was cut while swapped in: its copy
    for _, candidate in reversed(store.step_dirs(run_dir.checkpoints)):
        try:
            meta = store.read_meta(candidate, verify=False)
        except CheckpointError:
            continue
        origin = meta.get("origin")
        if origin and origin["path"] == origin_path:  # this run already went on from PATH
            if verify:
                meta = store.read_meta(candidate)
            return Start(candidate, meta, origin)
    if not path.is_dir():
        raise UserError(f"--resume {path}: no such checkpoint directory; give a step_NNNNNNN "
                        "directory of a run's checkpoints/, or --resume auto")
    meta = store.read_meta(path, verify=verify)
    step = int(meta["step"])
    existing = store.step_dirs(run_dir.checkpoints)
    if path.resolve().parent != run_dir.checkpoints.resolve():
        if existing:
            raise UserError(f"--resume {path}: run dir {run_dir} already has checkpoints of "
                            f"another run (up to step {existing[-1][0]}); resume into an empty "
                            "--run-dir")
        return Start(path, meta, {"path": origin_path, "step": step})
    later = [p for s, p in existing if s > step] if first_start else []
    return Start(path, meta, {"path": origin_path, "step": step}, later)


def _check_fit(cfg: TrainConfig, start: Start, run_dir: RunDir, mode: str,
               fingerprint: str, tokenizer: str | None) -> None:
    """The checkpoint must have this model's shape and optimizer and, unless switching
    deliberately, this data; never another tokenizer."""
    explicit = start.origin is not None and mode not in ("auto", "reset", "never")
    saved = start.meta["config"]
    # Both with every piece set: a checkpoint from before the pieces existed is model.arch gpt2.
    theirs = from_dict({"model": saved["model"]}, str(start.path)).model.resolved()
    mine = cfg.model.resolved()
    diff = [f"{k} {getattr(theirs, k)} -> {getattr(mine, k)}" for k in SHAPE_FIELDS
            if getattr(theirs, k) != getattr(mine, k)]
    diff = diff or [f"{k} {getattr(theirs, k)} -> {getattr(mine, k)}" for k in WIDTHS
                    if getattr(theirs, k) != getattr(mine, k)]
    optimizer = saved["optim"].get("name", "adamw")  # its state has that optimizer's layout
    if optimizer != cfg.optim.name:
        diff.append(f"optim.name {optimizer} -> {cfg.optim.name}")
    if diff and explicit:
        raise UserError(f"--resume {mode}: refused: that checkpoint has another model shape or "
                        f"optimizer ({', '.join(diff)}); resume it with the settings in its "
                        "meta.json")
    if diff:
        raise UserError(f"run dir {run_dir}: refused to resume checkpoint {start.path.name}, "
                        f"which has another model shape or optimizer ({', '.join(diff)}); use "
                        "another --run-dir, or --reset to set the old run aside")
    old = start.meta.get("data_fingerprint")
    if old is None or old == fingerprint:
        return
    where = f"--resume {mode}" if explicit else f"run dir {run_dir}: checkpoint {start.path.name}"
    trained_with = trained_tokenizer(start.path, start.meta)
    if tokenizer is not None and trained_with is not None and trained_with != tokenizer:
        own = saved["data"]["dir"]
        back = (f"To continue it on its own data, pass --data {own} (train --run-dir "
                f"{run_dir} alone takes the run's settings). " if own != cfg.data.dir else "")
        raise UserError(f"{where} was trained with another tokenizer ({_short(trained_with)}) "
                        f"than the one of data.dir = {cfg.data.dir} ({_short(tokenizer)}): its "
                        f"ids would mean other text. {back}--data.allow-switch is for new data "
                        "under the same tokenizer: prepare the new data with the run's tokenizer "
                        f"(ddpgpt prepare SOURCES --tokenizer-from {run_dir} --out DIR), or "
                        "start a new run")
    if cfg.data.allow_switch:
        start.data_switch = True
        return
    raise UserError(f"{where} was trained on another dataset ({saved['data']['dir']}, fingerprint "
                    f"{old[:12]}) than data.dir = {cfg.data.dir} (fingerprint {fingerprint[:12]}); "
                    "pass its --data, --reset to start over, or --data.allow-switch to go on with "
                    "the new data")


def _short(fingerprint: str) -> str:
    kind, _, digest = fingerprint.partition(":")
    return f"{kind} {digest[:12]}" if digest else kind


def settle(cfg: TrainConfig, start: Start, first_start: bool = True) -> TrainConfig:
    """The config this start trains with: optim.decay_steps = 0 becomes the schedule's end,
    run.steps where the schedule starts (a first start, or a new optim.schedule_start), and the
    checkpoint's on resume (older checkpoints: the run.steps they were saved with), so that
    raising run.steps does not re-shape the cosine mid-run; a wsd run resumed in its flat phase
    takes the new run.steps (schedule.extends_flat). A job's first start refuses a schedule that
    starts past its own start, or ends where it starts (a restart goes on as its job began)."""
    optim, steps = cfg.optim, cfg.run.steps
    if first_start and start.step < steps:
        _check_schedule(optim, start)
    if optim.decay_steps:
        return cfg
    if start.meta is not None:
        saved = start.meta["config"]
        kept = saved["optim"].get("decay_steps") or saved["run"]["steps"]
        anew = optim.schedule_start != saved["optim"].get("schedule_start", 0) \
            and start.step < steps
        # wsd resumed while flat goes on flat and decays at the new end (schedule.py).
        if not anew and not extends_flat(optim, kept, steps, start.step):
            steps = kept
    return dataclasses.replace(cfg, optim=dataclasses.replace(optim, decay_steps=steps))


def _check_schedule(optim: OptimConfig, start: Start) -> None:
    where = f"checkpoint {start.path.name}" if start.path is not None else "from scratch"
    if optim.schedule_start > start.step:
        raise ConfigError(f"optim.schedule_start = {optim.schedule_start} is past step "
                          f"{start.step}, where this run starts ({where}): a schedule starts at "
                          f"or before it; give --optim.schedule-start {start.step}")
    if 0 < optim.decay_steps <= optim.schedule_start:
        raise ConfigError(f"optim.decay_steps = {optim.decay_steps} ends the schedule at or "
                          f"before optim.schedule_start = {optim.schedule_start}, where it "
                          f"starts; give --optim.decay-steps N with N > {optim.schedule_start}, "
                          "or 0 (run.steps)")


def finished(cfg: TrainConfig, start: Start) -> bool:
    """The run already has a complete checkpoint at run.steps or beyond: there is nothing to
    train, and a launcher can say so without starting a worker. The checkpoint is verified
    (every file's hash) first: a damaged one would make the workers fall back to an older one."""
    if start.path is None or start.step < cfg.run.steps:
        return False
    try:
        store.read_meta(start.path, verify=True)
    except CheckpointError:
        return False
    return True


def report_finished(cfg: TrainConfig, run_dir: RunDir, start: Start) -> bool:
    """True, having said so in one line, when the run is already finished (nothing to train). The
    line is said under the run dir's lock: another run training there is refused, as always.
    A run that ended unhealthy (its last checkpoint says so) says that again, and exits 3."""
    if not finished(cfg, start):
        return False
    with run_dir.locked():
        print(finished_message(run_dir, start.step, cfg.run.steps), file=sys.stderr)
    if start.meta.get("unhealthy"):
        raise Unhealthy(start.meta["unhealthy"])
    return True


def finished_message(run_dir: RunDir, step: int, steps: int) -> str:
    """The line of a run that has nothing left to train, with its last evaluation's figures as
    metrics.jsonl recorded them (scoring the val split again would print the same number)."""
    row = evaluated_at(run_dir.metrics, step)
    figures = ", ".join(f"{k} {row[k]:.4f}" for k in ("val_loss", "val_bpb")
                        if isinstance((row or {}).get(k), float))
    return (f"run {run_dir} is already at step {step} of {steps}"
            f"{f' ({figures} at step {step})' if figures else ''}; raise run.steps to train "
            "further")

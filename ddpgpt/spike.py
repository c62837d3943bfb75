"""Loss spikes: found from the global loss, survived by rolling back past the data that caused them.

A step is a spike when its global loss (the mean of every rank's: the same number on every rank)
is above `run.spike_ratio` × the median of the losses of the last `run.spike_window` steps, or
when some rank's loss or gradient norm is not finite (with `run.on_nonfinite = spike`, the
default). It is found in the health exchange, before the optimizer step, so no update is ever
made from it. `run.on_spike` says what follows:

    rollback  (default) every rank reloads the newest checkpoint before the spike (or, if there
              is none, the run's starting point), moves the loader's cursor past the global
              batches from that checkpoint's step to the spike's, inclusive, multiplies the
              learning rate by run.rollback_lr_factor for run.rollback_lr_steps steps, and goes
              on. Once run.max_rollbacks rollbacks have happened within run.rollback_window
              steps, the next spike stops the run instead.
    stop      every rank stops before the update, naming the step; the checkpoints stay as
              they are
    none      finite spikes pass (a non-finite value still stops the run)

Rollback is the default because it is what people do by hand to a diverging run (OPT-175B's
logbook is a list of them): the cost of a false alarm is the steps since the checkpoint and a few
batches of data, each logged; the cost of a real spike that passes is the run. The data is
skipped because the batches just before a spike are its likeliest cause, and replaying them
replays it; the lower learning rate is for when the weights are the cause.

Reproducible. The detector's window of losses, the rollbacks so far and the lowered-lr window are
state saved in every checkpoint; the cursor is global, so the batches skipped are the same at any
W; a rollback reloads a checkpoint exactly as a restart does. The same command gives the same
losses, rollbacks included, and a run resumed after a rollback goes on bitwise as if it had not
stopped. Every rollback is a metrics.jsonl event row and one line on rank 0.
"""

from __future__ import annotations

import gc
import math
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from ddpgpt import checkpoint, dist, resume
from ddpgpt.config import RunConfig
from ddpgpt.errors import warn
from ddpgpt.run_dir import RunDir


@dataclass
class Spike:
    """A step whose loss spiked, as every rank saw it."""

    step: int                  # the step (1-based) that made no update
    loss: float                # its global loss (inf or nan when not finite)
    median: float              # the recent median it was compared with (nan: too few steps yet)
    ranks: list[int] = field(default_factory=list)  # ranks with a non-finite value, if any

    def describe(self, cfg: RunConfig, window: int) -> str:
        if self.ranks:
            return ("non-finite loss or gradient norm on rank "
                    f"{', '.join(map(str, self.ranks))}")
        return (f"loss spike: {self.loss:.4g} is above {cfg.spike_ratio:g} × the median "
                f"{self.median:.4g} of the last {window} steps")


class SpikeDetector:
    """The recent losses, the rollbacks of the run and the lowered-lr window: all of it state."""

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.losses: deque[float] = deque(maxlen=cfg.spike_window)
        self.rollbacks: list[dict] = []  # {"step": spike's, "to": checkpoint's, "batches": n}
        self.lr_until = 0                # steps up to this one train at the lowered lr

    def check(self, step: int, loss: float) -> Spike | None:
        """A Spike when `loss` is above the ratio × the recent median; else the loss joins
        the window."""
        if len(self.losses) == self.losses.maxlen:
            median = statistics.median(self.losses)
            if loss > self.cfg.spike_ratio * median:
                return Spike(step, loss, median)
        self.losses.append(loss)
        return None

    def nonfinite(self, step: int, loss: float, ranks: list[int]) -> Spike:
        median = statistics.median(self.losses) if self.losses else math.nan
        return Spike(step, loss, median, ranks)

    def lr_scale(self, step: int) -> float:
        """The factor on step `step`'s learning rate (1-based, as Spike.step)."""
        return self.cfg.rollback_lr_factor if step <= self.lr_until else 1.0

    def recent(self, step: int) -> int:
        """Rollbacks within run.rollback_window steps before `step`."""
        return sum(r["step"] > step - self.cfg.rollback_window for r in self.rollbacks)

    def state_dict(self) -> dict:
        return {"losses": list(self.losses), "rollbacks": [dict(r) for r in self.rollbacks],
                "lr_until": self.lr_until}

    def load_state_dict(self, state: dict | None) -> None:
        """`None`: a checkpoint from before spikes were tracked, or a fresh start."""
        state = state or {}
        self.losses.clear()
        self.losses.extend(float(x) for x in state.get("losses", []))
        self.rollbacks = [dict(r) for r in state.get("rollbacks", [])]
        self.lr_until = int(state.get("lr_until", 0))


def newest_before(run_dir: RunDir, step: int, origin: resume.Start) -> resume.Start:
    """The newest complete checkpoint of this run before `step`, or `origin` (where this
    process started: a checkpoint, or the initial state when its path is None)."""
    for saved, path in reversed(checkpoint.step_dirs(run_dir.checkpoints)):
        if saved >= step or saved < origin.step or (saved == origin.step and origin.path):
            continue  # the starting checkpoint itself is `origin`, which knows a data switch
        try:
            meta = checkpoint.read_meta(path)
        except checkpoint.CheckpointError as e:
            warn(f"rollback: skipping checkpoint {path.name}: {e}")
            continue
        return resume.Start(path, meta, origin=meta.get("origin"))
    return origin


def roll_back(trainer, spike: Spike, run_dir: RunDir, origin: resume.Start, metrics,
              build: Callable) -> object:
    """The trainer that goes on after `spike`: rebuilt from the newest checkpoint before it by
    `build(start)` (train.setup: the same path as a restart), the loader past the batches from
    there to the spike, the lr lowered. Collective: every rank decides the same and calls it."""
    cfg, guard, env = trainer.cfg.run, trainer.guard, trainer.env
    detector = guard.spikes
    target = newest_before(run_dir, spike.step, origin)
    read = trainer.loader.batch_index  # past the spike's batch: the cursor to skip to
    rollbacks, what = list(detector.rollbacks), spike.describe(cfg, len(detector.losses))
    trainer.doing = f"the rollback after step {spike.step}"
    trainer.close()  # the old model and optimizer go before the new ones are built
    gc.collect()
    guard.reset()
    new = build(target)
    # The batches from the checkpoint's cursor to the spike's: those of steps c+1..s, and any an
    # earlier rollback to the same checkpoint skipped on the way.
    batches = read - new.loader.batch_index
    skipped = new.loader.skip(batches)
    lr_until = target.step + cfg.rollback_lr_steps
    rollbacks.append({"step": spike.step, "to": target.step, "batches": batches})
    new.guard.spikes.rollbacks, new.guard.spikes.lr_until = rollbacks, lr_until
    name = target.path.name if target.path else "the initial state"
    steps = f" (steps {target.step + 1}-{spike.step})" * (batches == spike.step - target.step)
    metrics.write(f"ddpgpt: warning: step {spike.step}: {what}; rolling back to step "
                  f"{target.step} ({name}), skipping the {batches} global batch"
                  f"{'es' if batches > 1 else ''} read after it{steps}, lr × "
                  f"{cfg.rollback_lr_factor:g} for {cfg.rollback_lr_steps} steps (rollback "
                  f"{new.guard.spikes.recent(spike.step)} of at most {cfg.max_rollbacks} within "
                  f"{cfg.rollback_window} steps)")
    metrics.rewind(new.step)
    metrics.log_event(new.step, "rollback", spike_step=spike.step, spike_loss=_json(spike.loss),
                      median=_json(spike.median), nonfinite_ranks=spike.ranks,
                      checkpoint=str(target.path) if target.path else None,
                      checkpoint_step=target.step, skipped_batches=batches,
                      skipped_windows=skipped, lr_factor=cfg.rollback_lr_factor,
                      lr_until_step=lr_until, rollbacks=len(rollbacks))
    dist.barrier(env)  # every rank has rolled back before any trains on
    return new


def _json(x: float) -> float | str:
    """JSON has no nan or inf: those are written as strings."""
    return x if math.isfinite(x) else str(x)

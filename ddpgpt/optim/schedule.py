"""The schedule: what one optimizer step's update uses, as a pure function of the step.

    lr        warmup, then cosine | wsd | constant (optim.schedule), times the spike guard's
              rollback factor (run.rollback_lr_factor per rollback)
    momentum  Muon's, warming up from muon_momentum_start to muon_momentum

A schedule runs from step `schedule_start` (0: the run's first) to step `decay_steps` (its end;
its length is the difference). Every shape warms up linearly over its first `warmup_steps`
(its first step already trains, at lr/warmup). Then:
- cosine: from `lr` down to the floor (`min_lr`, a tenth of lr unset) at its end, then the floor;
- wsd (warmup, stable, decay): flat at `lr`, then linear down to the floor over the last
  `decay_fraction` of the schedule. Its end follows run.steps when a run resumed in its flat
  phase is given more steps (resume.settle): the point of WSD is that a run can be extended
  without a restart of the schedule;
- constant: flat at `lr` after warmup.

Cosine and wsd end at their end: every later step (a run extended past its schedule) is at the
floor, whatever the warmup, and a warmup as long as the schedule or longer is cut off by its end
(lr_at says it for every case; tests/unit/test_schedule.py checks the shape on a grid;
warmup_notes says it in a line). A run trained further than its schedule starts another at the
step it resumes at (optim.schedule_start): the first one's shape, moved there; the steps before
a schedule's start (trained again only after a rollback past it) are at the floor.

Being a pure function of the step, the schedule needs no state in a checkpoint; the rollback
factor lives with the spike guard (guard/spike.py), whose state resumes, and is read here at
every step, so that this is the one place where the lr a step uses is decided.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from ddpgpt.config.optim import OptimConfig


@dataclass(frozen=True)
class Rates:
    """One step's learning rate (before each group's lr_scale) and Muon's momentum."""
    lr: float
    momentum: float


def decay_start(cfg: OptimConfig, length: int) -> int:
    """wsd: the first step of the decay on a schedule of `length` steps, counted from its start
    (never inside warmup)."""
    return max(cfg.warmup_steps, length - max(1, round(cfg.decay_fraction * length)))


def lr_at(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """Learning rate of optimizer step `step` (0-based) on a schedule from S = `schedule_start`
    to E = `cfg.decay_steps`, or `total_steps` when that is 0 (unresolved: bench, tests): step
    S + s has the lr step s has on a schedule of L = E - S steps from 0. Defined for every
    (warmup, L, step):

    - cosine and wsd end at step E: every step from E on is at the floor, so a run extended past
      its schedule goes on at the floor, never at the peak again (unless a new schedule starts);
    - the warmup's steps s < warmup_steps (those before L, for cosine and wsd) are at
      lr · (s + 1) / warmup_steps: a schedule no longer than its warmup ends inside it;
    - when the warmup ends before L, the last step, E - 1, is exactly the floor for cosine and
      wsd (cosine's one decay step when warmup_steps = L - 1);
    - the steps before S are at the floor.

    So the lr rises, then never rises again: it is never above lr, and no step after the peak
    returns to it."""
    length = (cfg.decay_steps or total_steps) - cfg.schedule_start
    step -= cfg.schedule_start  # from here on the schedule's own steps
    if step < 0 or (cfg.schedule != "constant" and step >= length):
        return cfg.floor  # before this schedule, or after its end
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return cfg.lr
    # warmup_steps <= step < length from here
    if cfg.schedule == "wsd":
        start = decay_start(cfg, length)  # <= length - 1: step is at least warmup_steps
        if step < start:
            return cfg.lr
        progress = (step - start + 1) / (length - start)  # the floor at the last step
        return cfg.floor + (cfg.lr - cfg.floor) * (1 - progress)
    span = length - 1 - cfg.warmup_steps
    if span <= 0:  # the schedule's one step after warmup is its last
        return cfg.floor
    progress = (step - cfg.warmup_steps) / span
    return cfg.floor + 0.5 * (cfg.lr - cfg.floor) * (1 + math.cos(math.pi * progress))


def momentum_at(step: int, cfg: OptimConfig) -> float:
    """Muon's momentum at optimizer step `step`: from muon_momentum_start to muon_momentum over
    muon_momentum_warmup steps, then constant."""
    if step >= cfg.muon_momentum_warmup:
        return cfg.muon_momentum
    frac = step / cfg.muon_momentum_warmup
    return cfg.muon_momentum_start + frac * (cfg.muon_momentum - cfg.muon_momentum_start)


class Schedule:
    """The rates of every step of a run: `at(step)`. `rollback_factor()` is read at each call
    (the spike guard lowers it for the rest of the run at each rollback; 1 without one)."""

    def __init__(self, cfg: OptimConfig, total_steps: int,
                 rollback_factor: Callable[[], float] = lambda: 1.0):
        self.cfg, self.total_steps, self.rollback_factor = cfg, total_steps, rollback_factor

    def at(self, step: int) -> Rates:
        return Rates(lr_at(step, self.cfg, self.total_steps) * self.rollback_factor(),
                     momentum_at(step, self.cfg))


def extends_flat(cfg: OptimConfig, saved_end: int, new_end: int, step: int) -> bool:
    """wsd: a run resumed at `step` may stretch its schedule's end from `saved_end` to `new_end`
    when the step is still in the flat phase of both: the lr then goes on at its peak, with no
    jump, and the decay moves to the new end."""
    start, at = cfg.schedule_start, step - cfg.schedule_start
    return (cfg.schedule == "wsd" and new_end != saved_end
            and at < decay_start(cfg, saved_end - start) and at < decay_start(cfg, new_end - start))


def warmup_notes(cfg: OptimConfig, steps: int) -> list[str]:
    """The warning, if any, for a warmup that takes the whole schedule (run.steps = `steps`;
    `cfg` settled): the lr only rises and never decays (constant: may never reach its peak).
    Not refused: a run of a few steps, to see that a config works, is a fair thing to start."""
    end = steps if cfg.schedule == "constant" else cfg.decay_steps or steps
    length = end - cfg.schedule_start
    if not 0 < length <= cfg.warmup_steps:
        return []
    flat = cfg.schedule == "constant"
    return [f"optim.warmup_steps = {cfg.warmup_steps} is not shorter than the schedule ({length} "
            f"steps, to step {end}): the lr only rises, to {lr_at(end - 1, cfg, steps):.3g} at "
            f"step {end} of a peak of {cfg.lr:g} (optim.lr){'' if flat else ', and never decays'}"
            f"; give --optim.warmup-steps {length // 10} or so (a tenth of the schedule) for "
            f"{'steps at the peak' if flat else 'a warmup and a decay'}"]

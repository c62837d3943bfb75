"""The schedule: what one optimizer step's update uses, as a pure function of the step.

    lr        warmup, then cosine | wsd | constant (optim.schedule), times the spike guard's
              rollback factor (run.rollback_lr_factor per rollback)
    momentum  Muon's, warming up from muon_momentum_start to muon_momentum

Every shape warms up linearly over `warmup_steps` (step 0 already trains, at lr/warmup). Then:
- cosine: from `lr` down to `min_lr` at step `decay_steps` (the schedule's length), then min_lr;
- wsd (warmup, stable, decay): flat at `lr`, then linear down to `min_lr` over the last
  `decay_fraction` of the schedule. Its length follows run.steps when a run resumed in its flat
  phase is given more steps (resume.settle): the point of WSD is that a run can be extended
  without a restart of the schedule;
- constant: flat at `lr` after warmup.

Being a pure function of the step, the schedule needs no state in a checkpoint; the rollback
factor lives with the spike guard (guard/spike.py), whose state resumes, and is read here at
every step, so that this is the one place where the lr a step uses is decided.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from ddpgpt.config.schema import OptimConfig


@dataclass(frozen=True)
class Rates:
    """One step's learning rate (before each group's lr_scale) and Muon's momentum."""
    lr: float
    momentum: float


def decay_start(cfg: OptimConfig, length: int) -> int:
    """wsd: the first step of the decay on a schedule of `length` steps (never inside warmup)."""
    return max(cfg.warmup_steps, length - max(1, round(cfg.decay_fraction * length)))


def lr_at(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """Learning rate of optimizer step `step` (0-based) on a schedule of `cfg.decay_steps`
    steps, or `total_steps` when that is 0 (unresolved: bench, tests). The last step of the
    schedule is exactly min_lr for cosine and wsd."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    length = cfg.decay_steps or total_steps
    if cfg.schedule == "constant":
        return cfg.lr
    if cfg.schedule == "wsd":
        start = decay_start(cfg, length)
        if step < start:
            return cfg.lr
        progress = min(1.0, (step - start + 1) / (length - start))  # min_lr at the last step
        return cfg.min_lr + (cfg.lr - cfg.min_lr) * (1 - progress)
    span = max(1, length - 1 - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))


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


def extends_flat(cfg: OptimConfig, saved_length: int, new_length: int, step: int) -> bool:
    """wsd: a run resumed at `step` may stretch its schedule from `saved_length` to `new_length`
    steps when the step is still in the flat phase of both: the lr then goes on at its peak,
    with no jump, and the decay moves to the new end."""
    return (cfg.schedule == "wsd" and new_length != saved_length
            and step < decay_start(cfg, saved_length) and step < decay_start(cfg, new_length))

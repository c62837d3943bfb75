"""Optimizers: parameter groups and torch's AdamW + Muon as one (optimizer.py), Muon by whole
matrices (muon.py), the lr and momentum of every step (schedule.py)."""

from ddpgpt.optim.optimizer import (  # noqa: F401 -- the package's face
    Group,
    Optimizer,
    groups,
    is_muon_param,
    load_state,
    set_lr,
    upgrade,
)
from ddpgpt.optim.schedule import Rates, Schedule, lr_at, momentum_at  # noqa: F401

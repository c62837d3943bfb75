"""Optimizers: parameter groups and torch's AdamW + Muon as one (optimizer.py), Muon by whole
matrices (muon.py)."""

from ddpgpt.optim.optimizer import (  # noqa: F401 -- the package's face
    Group,
    Optimizer,
    groups,
    is_muon_param,
    load_state,
    lr_at,
    set_lr,
    upgrade,
)

"""The optimizer (AdamW, or Muon + AdamW: ddpgpt/muon.py) and the learning-rate schedule.

The schedule is a pure function of the step, so a resumed run needs no scheduler state: linear
warmup over `warmup_steps` (step 0 already trains, at lr/warmup), then a cosine from `lr` down to
`min_lr` at step `decay_steps` (resolved on the run's first start, kept on resume), then `min_lr`.

A resumed run keeps the optimizer's state (moments, momentum buffers, step counts) but takes its
hyperparameters (weight decay, betas, eps, Muon's lr scale and Newton-Schulz steps) from this
run's config, not from the saved param_groups: a setting changed on resume is applied, and
metrics.jsonl records the change.
"""

from __future__ import annotations

import math

import torch

from ddpgpt.config import OptimConfig


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Matrices and embeddings (dim >= 2) decay; biases and LayerNorm gains (dim < 2) do not."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def make_optimizer(model: torch.nn.Module, cfg: OptimConfig, device: torch.device,
                   env=None) -> torch.optim.Optimizer:
    """optim.name: torch's AdamW, the fused kernel on CUDA (one launch for all parameters); or
    Muon for the blocks' matrices and AdamW for the rest, one object (`env`: who orthogonalizes
    which matrix)."""
    if cfg.name == "muon":
        from ddpgpt.muon import make_muon
        return make_muon(model, cfg, env, device)
    return torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr,
                             betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=device.type == "cuda")


def lr_at(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """Learning rate of optimizer step `step` (0-based) on a schedule of `cfg.decay_steps`
    steps, or `total_steps` when that is 0 (unresolved: bench, tests)."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, (cfg.decay_steps or total_steps) - 1 - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, lr: float, momentum: float | None = None) -> None:
    """Every group's lr (times its lr_scale: Muon's lr over AdamW's), and Muon's momentum."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)
        if momentum is not None and group.get("kind") == "muon":
            group["momentum"] = momentum


def load_state(optimizer: torch.optim.Optimizer, state: dict) -> None:
    """A saved optimizer state, with this run's hyperparameters: torch's load_state_dict also
    restores the saved param_groups, which would silently undo a setting changed on resume."""
    configured = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    optimizer.load_state_dict(state)
    for group, hyper in zip(optimizer.param_groups, configured):
        group.update(hyper)

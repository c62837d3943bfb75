"""How gradients are synchronized across ranks (run.sync): one table of modes, and one small
interface (sync/base.py) that the Trainer calls the same way whatever the mode.

    sync = make(cfg.run.sync, model, groups, env, bucket_mb)   # wraps the model, lays it out
    optimizer = Optimizer(groups, sync.params(), ...)           # over what this rank steps
    for each micro-step m of A:
        with sync.micro_step(last=m == A - 1):
            sync.model(x, y), backward   # on the last one, the gradient sync starts in backward
    sync.finish()                        # every rank holds the mean gradient (zero1: its shards)
    norm = sync.clip(max_norm)           # the global gradient norm
    sync.before_update(); optimizer.step(); sync.after_update(); sync.zero_grad()
    sync.model_state(), sync.optimizer_state(optimizer)   # checkpoints: full tensors, the layout
                                                          # of torch's optimizers over the whole
                                                          # model, whatever the mode and W

The table (`MODES`, sync/modes.py) is the one place that says what a mode can do: where its code
lives, whether it shards the optimizer state or reduce-scatters its buckets, whether it works with
fp16's loss scaler and with gradient compression, and the bytes a rank sends per step, with the
schedule that decides how much of them the backward hides. A new mode is one file under sync/ and
one row there.

This module imports no torch: the command line checks run.sync against the table before any heavy
import. At world size 1 every mode is the model itself, with no collective (unless a one-rank
group was asked for: `ddpgpt bench --group`).
"""

from __future__ import annotations

import importlib

from ddpgpt.sync.modes import MODES, Mode, Traffic, check  # noqa: F401 -- the package's face


def make(mode: str, model, groups: list, env, bucket_mb: float = 25.0, compress: str = "none"):
    """The Sync of `mode` around the single-device `model`, which it wraps and lays out for
    `groups` (optim.groups: the optimizer's parameter groups over the whole model). mode=None, or
    no process group: the model alone, no collective. `compress` bf16: gradients travel in
    bfloat16 (they still accumulate in fp32)."""
    if mode is not None:
        check(mode)
    if mode is None or env.backend is None:
        from ddpgpt.sync.base import Sync
        return Sync(model, groups, env, bucket_mb)
    module, name = MODES[mode].impl.split(":")
    cls = getattr(importlib.import_module(module), name)
    return cls(model, groups, env, bucket_mb, mode=mode, compress=compress)

"""How gradients are synchronized across ranks: one small interface that the Trainer calls the
same way whatever the mode (run.sync).

    sync = make(cfg.run.sync, model, env, bucket_mb)
    sync.model                      # what runs the forward: DDP(model), or the model itself
    for each micro-step m of A:
        with sync.micro_step(last=m == A - 1):
            forward, backward       # on the last one, the gradient sync starts during backward
    sync.finish()                   # every rank now holds the mean gradient over all ranks
    optimizer.step(); sync.zero_grad(optimizer)

Modes:
    ddp        torch's DistributedDataParallel: its buckets all-reduce during the last backward
    allreduce  our own flat buckets: one asynchronous all_reduce per bucket, issued as soon as the
               bucket's last gradient is ready in the last backward, waited on in finish()
    rs-ag      the same buckets, each synced as a reduce-scatter (every rank sums its 1/W slice)
               then an all-gather (every rank gets every slice back): the two halves of a ring
               all-reduce, and what the sharded modes are made of

At world size 1 every mode is the model itself, with no collective. The optimizer and the
checkpoint never see the mode: the gradients are plain `.grad` tensors of the single-device model.
"""

from __future__ import annotations

import contextlib

import torch

from ddpgpt import dist

MODES = ("ddp", "allreduce", "rs-ag")


class Local:
    """World size 1: nothing to synchronize."""

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def micro_step(self, last: bool):
        return contextlib.nullcontext()

    def finish(self) -> None:
        pass

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.zero_grad(set_to_none=True)

    def close(self) -> None:
        pass


def make(mode: str, model: torch.nn.Module, env: dist.DistEnv, bucket_mb: float):
    if mode not in MODES:
        raise ValueError(f"unknown sync mode {mode!r}")
    if env.world_size == 1:
        return Local(model)
    if mode == "ddp":
        from ddpgpt.sync.ddp import DDPSync
        return DDPSync(model, env, bucket_mb)
    from ddpgpt.sync.buckets import BucketSync
    return BucketSync(model, env, bucket_mb, reduce_scatter=mode == "rs-ag")

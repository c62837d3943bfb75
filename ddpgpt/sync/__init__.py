"""How gradients are synchronized across ranks: one small interface that the Trainer calls the
same way whatever the mode (run.sync).

    sync = make(cfg.run.sync, model, env, bucket_mb, optimizer)
    sync.model, sync.optimizer      # what runs the forward (DDP(model), or the model itself), and
                                    # what steps (the optimizer, or zero1's over its shards)
    for each micro-step m of A:
        with sync.micro_step(last=m == A - 1):
            forward, backward       # on the last one, the gradient sync starts during backward
    sync.finish()                   # every rank now holds the mean gradient (zero1: its shards)
    norm = sync.clip(max_norm)      # the global gradient norm
    sync.optimizer.step(); sync.after_update(); sync.zero_grad()
    sync.model_state(), sync.optimizer_state()   # for checkpoints: full tensors, torch's AdamW
                                                 # layout, whatever the mode

Modes:
    ddp        torch's DistributedDataParallel: its buckets all-reduce during the last backward
    allreduce  our own flat buckets: one asynchronous all_reduce per bucket, issued as soon as the
               bucket's last gradient is ready in the last backward, waited on in finish()
    rs-ag      the same buckets, each synced as a reduce-scatter (every rank sums its 1/W slice)
               then an all-gather (every rank gets every slice back): the two halves of a ring
               all-reduce, and what the sharded modes are made of
    zero1      the reduce-scatter half only: each rank steps AdamW on its 1/W of the parameters,
               with its 1/W of the optimizer state, then the parameters are all-gathered
    fsdp2      torch's fully_shard on each block and the root: parameters, gradients and
               optimizer state all sharded 1/W

At world size 1 every mode is the model itself, with no collective (unless a one-rank group was
asked for: `ddpgpt bench --group`). The optimizer and the
checkpoint never see the mode: the gradients are plain `.grad` tensors of the single-device model.
"""

from __future__ import annotations

import contextlib

import torch

from ddpgpt import dist
from ddpgpt.config import SYNC_MODES

MODES = SYNC_MODES


class Sync:
    """What every mode does unless it says otherwise; at world size 1, all of it."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 raw: torch.nn.Module | None = None):
        self.model, self.optimizer = model, optimizer
        self.raw = model if raw is None else raw  # the single-device model

    def micro_step(self, last: bool):
        return contextlib.nullcontext()

    def finish(self) -> None:
        pass

    def clip(self, max_norm: float) -> torch.Tensor:
        """Every rank holds the whole mean gradient: this is the global norm."""
        params = [p for p in self.optimizer_params() if p.grad is not None]
        return torch.nn.utils.clip_grad_norm_(params, max_norm)

    def optimizer_params(self) -> list[torch.nn.Parameter]:
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def after_update(self) -> None:
        pass

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def optimizer_state(self) -> dict:
        return self.optimizer.state_dict()

    def model_state(self, raw: torch.nn.Module) -> dict:
        """The whole single-device model's weights (collective for the sharded modes)."""
        return raw.state_dict()

    def memory(self) -> dict[str, int]:
        """Bytes this rank holds for the parameters, their gradients and the optimizer state."""
        params = list(self.raw.parameters())
        return {"params": nbytes(params), "grads": nbytes(p.grad for p in params),
                "state": nbytes(v for s in self.optimizer.state.values() for v in s.values())}

    def close(self) -> None:
        pass


def nbytes(tensors) -> int:
    """Bytes of the tensors (a DTensor's local shard; scalars such as AdamW's step excluded)."""
    total = 0
    for t in tensors:
        if torch.is_tensor(t) and t.dim() > 0:
            t = t.to_local() if hasattr(t, "to_local") else t
            total += t.numel() * t.element_size()
    return total


def make(mode: str, model: torch.nn.Module, env: dist.DistEnv, bucket_mb: float,
         optimizer: torch.optim.Optimizer, compress: str = "none"):
    """`compress`: bf16 sends the gradients in bfloat16 (they still accumulate in fp32)."""
    if mode not in MODES:
        raise ValueError(f"unknown sync mode {mode!r}")
    if env.backend is None:  # world size 1 without a group (a one-rank group runs the mode)
        return Sync(model, optimizer)
    wire = torch.bfloat16 if compress == "bf16" else None
    if mode == "ddp":
        from ddpgpt.sync.ddp import DDPSync
        return DDPSync(model, env, bucket_mb, optimizer, compress=wire is not None)
    if mode == "fsdp2":
        if compress != "none":
            raise ValueError("fsdp2 reduces gradients in its own dtype (no grad_compress)")
        from ddpgpt.sync.fsdp2 import FSDP2Sync
        return FSDP2Sync(model, env, optimizer)
    if mode == "zero1":
        from ddpgpt.sync.zero1 import Zero1Sync
        return Zero1Sync(model, env, bucket_mb, optimizer, wire_dtype=wire)
    from ddpgpt.sync.buckets import BucketSync
    groups = [g["params"] for g in optimizer.param_groups]
    return BucketSync(model, groups, env, bucket_mb, reduce_scatter=mode == "rs-ag",
                      optimizer=optimizer, wire_dtype=wire)

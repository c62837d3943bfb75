"""run.sync = ddp: torch's DistributedDataParallel."""

from __future__ import annotations

import contextlib

import torch

from ddpgpt import dist


class DDPSync:
    def __init__(self, model: torch.nn.Module, env: dist.DistEnv, bucket_mb: float):
        self.model = dist.wrap_model(model, env, bucket_mb)

    def micro_step(self, last: bool):
        """Before the last micro-step DDP skips its all-reduce: gradients accumulate locally."""
        return contextlib.nullcontext() if last else self.model.no_sync()

    def finish(self) -> None:
        pass  # DDP's all-reduces finish inside the last backward

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.zero_grad(set_to_none=True)

    def close(self) -> None:
        """No DDP wrapper may outlive the process group (see dist.shutdown)."""
        self.model = None

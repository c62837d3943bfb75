"""run.sync = ddp: torch's DistributedDataParallel."""

from __future__ import annotations

import contextlib

import torch

from ddpgpt import dist
from ddpgpt.sync import Sync


class DDPSync(Sync):
    def __init__(self, model: torch.nn.Module, env: dist.DistEnv, bucket_mb: float,
                 optimizer: torch.optim.Optimizer):
        super().__init__(dist.wrap_model(model, env, bucket_mb), optimizer)

    def micro_step(self, last: bool):
        """Before the last micro-step DDP skips its all-reduce: gradients accumulate locally."""
        return contextlib.nullcontext() if last else self.model.no_sync()

    def close(self) -> None:
        """No DDP wrapper may outlive the process group (see dist.shutdown)."""
        self.model = None

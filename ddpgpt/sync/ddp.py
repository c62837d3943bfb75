"""run.sync = ddp: torch's DistributedDataParallel."""

from __future__ import annotations

import contextlib

import torch

from ddpgpt import dist
from ddpgpt.optim.optimizer import Group
from ddpgpt.sync.base import Replicated


class DDPSync(Replicated):
    def __init__(self, model: torch.nn.Module, groups: list[Group], env: dist.DistEnv,
                 bucket_mb: float, mode: str = "ddp", compress: str = "none"):
        super().__init__(model, groups, env, bucket_mb)
        self.name = mode
        self.model = dist.wrap_model(model, env, bucket_mb)
        if compress == "bf16":
            self.model.register_comm_hook(None, bf16_hook(env))

    def micro_step(self, last: bool):
        """Before the last micro-step DDP skips its all-reduce: gradients accumulate locally."""
        return contextlib.nullcontext() if last else self.model.no_sync()

    def close(self) -> None:
        """No DDP wrapper may outlive the process group (see dist.shutdown)."""
        self.model = None


def bf16_hook(env: dist.DistEnv):
    """A DDP comm hook: each bucket travels in bf16 (summed, then divided by W in fp32). Ours
    rather than torch's bf16_compress_hook, which needs NCCL: this one runs on gloo too."""
    def hook(state, bucket):
        grads = bucket.buffer()
        wire = grads.to(torch.bfloat16)

        def unpack(fut):
            return grads.copy_(fut.value()[0]).div_(env.world_size)

        return dist.all_reduce_async(env, wire).get_future().then(unpack)

    return hook

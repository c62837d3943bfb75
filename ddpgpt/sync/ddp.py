"""run.sync = ddp: torch's DistributedDataParallel."""

from __future__ import annotations

import contextlib
import inspect

import torch
from torch.nn.parallel import DistributedDataParallel

from ddpgpt.distributed import collectives
from ddpgpt.distributed.group import DistEnv
from ddpgpt.optim.optimizer import Group
from ddpgpt.sync.base import Replicated


def wrap_model(model: torch.nn.Module, env: DistEnv,
               bucket_mb: float = 25.0) -> torch.nn.Module:
    """DDP when there is a process group (W > 1, or bench's one-rank group), else the model.

    init_sync=False: DDP would otherwise broadcast rank 0's weights and hide a rank that built
    different ones; ranks instead build identical weights from one seed and `agree` proves it.
    No buffer broadcast: the model has no buffers that change during training."""
    if env.backend is None:
        return model
    # torch >= 2.12 renames broadcast_buffers to forward_sync_buffers (and warns on the old name).
    params = inspect.signature(DistributedDataParallel.__init__).parameters
    no_buffer_sync = {"forward_sync_buffers" if "forward_sync_buffers" in params
                      else "broadcast_buffers": False}
    return DistributedDataParallel(
        model, device_ids=[env.device.index] if env.device.type == "cuda" else None,
        init_sync=False, bucket_cap_mb=bucket_mb, gradient_as_bucket_view=True, **no_buffer_sync,
    )


class DDPSync(Replicated):
    def __init__(self, model: torch.nn.Module, groups: list[Group], env: DistEnv,
                 bucket_mb: float, mode: str = "ddp", compress: str = "none"):
        super().__init__(model, groups, env, bucket_mb)
        self.name = mode
        self.model = wrap_model(model, env, bucket_mb)
        if compress == "bf16":
            self.model.register_comm_hook(None, bf16_hook(env))

    def micro_step(self, last: bool):
        """Before the last micro-step DDP skips its all-reduce: gradients accumulate locally."""
        return contextlib.nullcontext() if last else self.model.no_sync()

    def close(self) -> None:
        """No DDP wrapper may outlive the process group (see group.shutdown)."""
        self.model = None


def bf16_hook(env: DistEnv):
    """A DDP comm hook: each bucket travels in bf16 (summed, then divided by W in fp32). Ours
    rather than torch's bf16_compress_hook, which needs NCCL: this one runs on gloo too."""
    def hook(state, bucket):
        grads = bucket.buffer()
        wire = grads.to(torch.bfloat16)

        def unpack(fut):
            return grads.copy_(fut.value()[0]).div_(env.world_size)

        return collectives.all_reduce_async(env, wire).get_future().then(unpack)

    return hook

"""run.sync = allreduce | rs-ag: data parallelism without DDP, on flat bucketed gradient buffers.

Layout. The parameters are grouped, last registered first (gradients become ready roughly in the
reverse order of the forward), into buckets of at most run.bucket_mb. Each bucket is one flat
buffer (padded to a multiple of W for rs-ag), and every parameter's `.grad` is a view into it:
autograd accumulates the micro-steps' gradients straight into the buffer, and a collective moves
one tensor per bucket, never one per parameter.

Overlap. Each parameter has a post-accumulate-grad hook. In the last micro-step's backward the
hook counts the bucket's gradients as they become final; when the last one is, the bucket's
collective is issued asynchronously, while the backward goes on with earlier layers. `finish`
waits for every bucket and divides by W once: the sum is exact, then one division, as the mean
needs (DDP divides each rank's gradient by W before summing, so the two differ by rounding).

rs-ag. A bucket's reduce-scatter is issued from the hook, its all-gather in `finish` once the
reduce-scatter is done (two collectives on one buffer must not run at once). Padding elements are
zero on every rank, so they sum to zero, and no parameter's gradient is ever a view of them.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field

import torch

from ddpgpt.distributed import collectives
from ddpgpt.distributed.group import DistEnv, collective
from ddpgpt.optim.optimizer import Group
from ddpgpt.sync.base import Replicated, nbytes
from ddpgpt.sync.modes import MODES


def plan(sizes: list[int], bucket_elems: int, multiple: int) -> list[tuple[list[int], int]]:
    """Groups consecutive parameter indices into buckets of at most `bucket_elems` elements (a
    larger parameter gets a bucket of its own); returns (indices, buffer size) per bucket, the
    size rounded up to a multiple of `multiple`."""
    buckets, current, filled = [], [], 0
    for i, n in enumerate(sizes):
        if current and filled + n > bucket_elems:
            buckets.append(current)
            current, filled = [], 0
        current.append(i)
        filled += n
    if current:
        buckets.append(current)
    return [(b, -(-sum(sizes[i] for i in b) // multiple) * multiple) for b in buckets]


@dataclass
class Bucket:
    params: list[torch.nn.Parameter]
    offsets: list[int]                # where each parameter starts in the flat layout
    buffer: torch.Tensor              # (size,): every parameter's gradient, zero elsewhere
    shard: torch.Tensor | None        # (size / W,): this rank's summed slice (rs-ag, zero1)
    wire: torch.Tensor                # what the collectives move: the buffer, or a bf16 copy
    wire_shard: torch.Tensor | None   # the shard as it travels: `shard`, or a bf16 copy
    ready: int = 0                    # gradients final in this backward
    works: list = field(default_factory=list)

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter's piece of a flat tensor laid out like the buffer, in its shape."""
        return [flat[o:o + p.numel()].view_as(p) for p, o in zip(self.params, self.offsets)]


def packed(params: list[torch.nn.Parameter], start: int = 0) -> list[int]:
    """Offsets of parameters laid out one after the other from `start`."""
    offsets = []
    for p in params:
        offsets.append(start)
        start += p.numel()
    return offsets


class BucketSync(Replicated):
    def __init__(self, model: torch.nn.Module, groups: list[Group], env: DistEnv,
                 bucket_mb: float, mode: str = "allreduce", compress: str = "none"):
        """Buckets never mix the optimizer's parameter groups (zero1 steps a bucket's slice as
        one tensor); each group's parameters are bucketed last first."""
        super().__init__(model, groups, env, bucket_mb)
        self.name = mode
        self.reduce_scatter = MODES[mode].reduce_scatter
        self.wire_dtype = torch.bfloat16 if compress == "bf16" else None
        params = [p for g in groups for p in g.params]
        assert all(p.dtype == params[0].dtype for p in params), "one gradient dtype per model"
        self.bucket_elems = max(1, int(bucket_mb * 2**20) // params[0].element_size())
        self.buckets: list[Bucket] = []
        self._hooks = []
        for group in groups:
            for bucket_params, offsets, size in self.layout(group):
                self.buckets.append(self._bucket(bucket_params, offsets, size))
        self.syncing = False

    def layout(self, group: Group) -> list[tuple[list[torch.nn.Parameter], list[int], int]]:
        """(parameters, their offsets, buffer size) per bucket of one group: consecutive
        parameters, last first, the size a multiple of W for the reduce-scatter."""
        params = group.params[::-1]
        multiple = self.env.world_size if self.reduce_scatter else 1
        out = []
        for indices, size in plan([p.numel() for p in params], self.bucket_elems, multiple):
            members = [params[i] for i in indices]
            out.append((members, packed(members), size))
        return out

    def _bucket(self, params: list[torch.nn.Parameter], offsets: list[int], size: int) -> Bucket:
        W = self.env.world_size
        buffer = torch.zeros(size, dtype=params[0].dtype, device=params[0].device)
        shard = buffer.new_zeros(size // W) if self.reduce_scatter else None
        wire, wire_shard = buffer, shard
        if self.wire_dtype is not None:  # gradients travel in bf16, accumulate in fp32
            wire = buffer.to(self.wire_dtype)
            wire_shard = shard.to(self.wire_dtype) if shard is not None else None
        bucket = Bucket(params, offsets, buffer, shard, wire, wire_shard)
        for p, view in zip(params, bucket.views(buffer)):
            p.grad = view  # autograd accumulates into it in place
            self._hooks.append(p.register_post_accumulate_grad_hook(
                functools.partial(self._ready, bucket)))
        return bucket

    def micro_step(self, last: bool):
        self.syncing = last  # the hooks issue collectives only in the last micro-step's backward
        return contextlib.nullcontext()

    def _ready(self, bucket: Bucket, param: torch.nn.Parameter) -> None:
        if self.syncing:
            bucket.ready += 1
            if bucket.ready == len(bucket.params):
                self._issue(bucket)

    def _issue(self, bucket: Bucket) -> None:
        if bucket.wire is not bucket.buffer:
            bucket.wire.copy_(bucket.buffer)
        if self.reduce_scatter:
            bucket.works.append(collectives.reduce_scatter_async(self.env, bucket.wire_shard,
                                                                 bucket.wire))
        else:
            bucket.works.append(collectives.all_reduce_async(self.env, bucket.wire))

    def finish(self) -> None:
        """Waits for every bucket and leaves the mean gradient in every `.grad`."""
        self._issue_the_rest()
        for bucket in self.buckets:
            self._wait(bucket)
            if self.reduce_scatter:
                bucket.works = [collectives.all_gather_async(self.env, bucket.wire,
                                                             bucket.wire_shard)]
        for bucket in self.buckets:
            self._land(bucket, bucket.wire, bucket.buffer)
        self.syncing = False

    def _land(self, bucket: Bucket, wire: torch.Tensor, target: torch.Tensor) -> None:
        """Waits for the bucket's collectives and leaves the mean of the summed `wire` (bf16
        under compression) in `target`; the bucket is ready for the next step."""
        self._wait(bucket)
        if wire is not target:
            target.copy_(wire)
        target.div_(self.env.world_size)
        bucket.ready, bucket.works = 0, []

    def _issue_the_rest(self) -> None:
        """Issues the buckets whose gradients never all arrived (a parameter unused in this
        forward has no hook call)."""
        for bucket in self.buckets:
            if not bucket.works:
                self._issue(bucket)

    def _wait(self, bucket: Bucket) -> None:
        with collective():
            for work in bucket.works:
                work.wait()

    def zero_grad(self) -> None:
        """In place: the gradients must stay views of the buffers (never set to None)."""
        for bucket in self.buckets:
            bucket.buffer.zero_()

    def memory(self, optimizer) -> dict[str, int]:
        held = super().memory(optimizer)
        buffers = {id(t): t for b in self.buckets for t in (b.buffer, b.shard, b.wire, b.wire_shard)
                   if t is not None}  # without compression the wire is the buffer itself
        held["grads"] = nbytes(buffers.values())
        return held

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []


"""run.sync = zero1: each rank keeps and steps 1/W of the optimizer state (ZeRO stage 1).

The gradients travel as in rs-ag, but only the reduce-scatter half: after it, rank r holds the
mean gradient of its slice of every bucket and nothing more. Every parameter is a view of a flat
buffer laid out like its gradient bucket; rank r's slice of that buffer is the one parameter
its AdamW steps, with its 1/W of the moments. After the step the updated slices are all-gathered
back into the buffers, so every rank again holds the whole model.

AdamW is elementwise, so stepping slices gives the same update as stepping whole tensors. The
gradient norm for clipping is global: each rank sums the squares of its slices and the sums are
all-reduced. Buckets never mix the optimizer's parameter groups (weight decay or not).

The checkpoint does not see the mode: `optimizer_state()` gathers the slices into the state_dict
layout of torch's AdamW over the whole model, and a state in that layout is sliced again when a
run resumes under zero1, whatever mode and W saved it.
"""

from __future__ import annotations

import math

import torch

from ddpgpt import dist
from ddpgpt.sync import nbytes
from ddpgpt.sync.buckets import BucketSync

MOMENTS = ("exp_avg", "exp_avg_sq")


class Zero1Sync(BucketSync):
    def __init__(self, model: torch.nn.Module, env: dist.DistEnv, bucket_mb: float,
                 optimizer: torch.optim.Optimizer, wire_dtype: torch.dtype | None = None):
        super().__init__(model, [g["params"] for g in optimizer.param_groups], env, bucket_mb,
                         reduce_scatter=True, optimizer=optimizer, wire_dtype=wire_dtype)
        self.full = optimizer  # over the whole model: the layout checkpoints hold
        group_of = {id(p): i for i, g in enumerate(optimizer.param_groups) for p in g["params"]}
        shards: list[list[torch.nn.Parameter]] = [[] for _ in optimizer.param_groups]
        for bucket in self.buckets:
            bucket.flat = bucket.buffer.new_zeros(bucket.buffer.numel())  # the parameters' values
            for p, view in zip(bucket.params, bucket.views(bucket.flat)):
                view.copy_(p.detach())
                p.data = view
            bucket.param_shard = torch.nn.Parameter(self._slice(bucket.flat))
            bucket.param_shard.grad = bucket.shard  # the reduce-scatter writes the gradient here
            shards[group_of[id(bucket.params[0])]].append(bucket.param_shard)
        hyper = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        self.optimizer = type(optimizer)([{**h, "params": s} for h, s in zip(hyper, shards)])
        self._load_slices()

    def _slice(self, flat: torch.Tensor) -> torch.Tensor:
        n = flat.numel() // self.env.world_size
        return flat[self.env.rank * n:(self.env.rank + 1) * n]

    def finish(self) -> None:
        """Rank r ends with the mean gradient of its slices (no all-gather of gradients)."""
        self._issue_the_rest()
        for bucket in self.buckets:
            self._wait(bucket)
            if bucket.wire_shard is not bucket.shard:
                bucket.shard.copy_(bucket.wire_shard)
            bucket.shard.div_(self.env.world_size)
            bucket.ready, bucket.works = 0, []
        self.syncing = False

    def clip(self, max_norm: float) -> torch.Tensor:
        """The global gradient norm (squared slice norms summed over ranks; padding is zero), and
        the slices scaled as torch's clip_grad_norm_ scales whole gradients."""
        squares = torch.stack([b.shard.float().pow(2).sum() for b in self.buckets]).sum()
        norm = dist.all_reduce(self.env, squares).sqrt()
        if math.isfinite(max_norm):
            coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
            for bucket in self.buckets:
                bucket.shard.mul_(coef.to(bucket.shard.dtype))
        return norm

    def after_update(self) -> None:
        """Every rank gets every rank's updated slices back: the whole model again."""
        works = [dist.all_gather_async(self.env, b.flat, b.param_shard.detach().clone())
                 for b in self.buckets]
        with dist.collective():
            for work in works:
                work.wait()

    # ---- the optimizer state, in the layout that does not depend on the mode -------------------

    def _load_slices(self) -> None:
        """Slices the whole-model optimizer's state (loaded from a checkpoint, or empty)."""
        for bucket in self.buckets:
            states = [self.full.state.get(p) for p in bucket.params]
            if not states[0]:
                continue
            state = {"step": states[0]["step"].clone()}
            for key in MOMENTS:
                flat = bucket.flat.new_zeros(bucket.flat.numel())
                for view, s in zip(bucket.views(flat), states):
                    view.copy_(s[key])
                state[key] = self._slice(flat).clone()
            self.optimizer.state[bucket.param_shard] = state
        self.full.state.clear()  # the whole-model moments are not kept: 1/W per rank

    def optimizer_state(self) -> dict:
        """Collective: the state_dict torch's AdamW over the whole model would have."""
        for full, sharded in zip(self.full.param_groups, self.optimizer.param_groups):
            full.update({k: v for k, v in sharded.items() if k != "params"})  # lr and friends
        for bucket in self.buckets:
            state = self.optimizer.state.get(bucket.param_shard)
            if not state:
                continue
            gathered = {}
            for key in MOMENTS:
                flat = bucket.flat.new_zeros(bucket.flat.numel())
                dist.all_gather_async(self.env, flat, state[key].contiguous()).wait()
                gathered[key] = bucket.views(flat)
            for i, p in enumerate(bucket.params):
                self.full.state[p] = {"step": state["step"].clone(),
                                      **{key: gathered[key][i].clone() for key in MOMENTS}}
        state_dict = self.full.state_dict()
        self.full.state.clear()
        return state_dict

    def memory(self) -> dict[str, int]:
        held = super().memory()  # the buffers: whole gradients and shards; the sharded state
        held["params"] = nbytes(b.flat for b in self.buckets)  # the model: views of these
        return held

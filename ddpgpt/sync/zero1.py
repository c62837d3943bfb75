"""run.sync = zero1: each rank keeps and steps 1/W of the optimizer state (ZeRO stage 1).

The gradients travel as in rs-ag, but only the reduce-scatter half: after it, rank r holds the
mean gradient of its slice of every bucket and nothing more. Every parameter is a view of a flat
buffer laid out like its gradient bucket, and after the step every rank's slices are
all-gathered back into the buffers, so every rank again holds the whole model.

What a slice is depends on the optimizer:
- AdamW is elementwise, so rank r's slice of an AdamW bucket is its 1/W of the elements, stepped
  as one flat tensor with its 1/W of the moments: the same update as stepping whole tensors.
- Muon needs whole matrices (muon.py). A Muon bucket is laid out rank by rank: rank r's part holds
  the whole matrices it owns, every part padded to the largest one (the owners are balanced so
  that the padding is small: none for gpt2-124m at W = 2 or 4). The reduce-scatter then hands
  each owner the mean gradient of exactly its matrices, its Muon steps them as 2-D views of the
  buffer with their momentum only, and the all-gather that shares AdamW's slices shares them.
  The matrices cost the same bytes as in any zero1 bucket: one reduce-scatter, one all-gather.

The gradient norm for clipping is global: each rank sums the squares of its slices (padding is
zero) and the sums are all-reduced. The checkpoint does not see the mode: `optimizer_state()`
gathers the slices into torch's AdamW state_dict over the whole model (and Muon's over every
matrix), and a state in that layout is sliced again when a run resumes under zero1, whatever mode
and W saved it.
"""

from __future__ import annotations

import math

import torch

from ddpgpt.checkpoint.sharded import Pieces, flat_range
from ddpgpt.distributed import collectives
from ddpgpt.distributed.group import DistEnv, collective
from ddpgpt.optim.optimizer import Group, Optimizer
from ddpgpt.sync.base import MOMENTS, adamw_state, nbytes
from ddpgpt.sync.buckets import Bucket, BucketSync, packed


class Zero1Sync(BucketSync):
    def __init__(self, model: torch.nn.Module, groups: list[Group], env: DistEnv,
                 bucket_mb: float, mode: str = "zero1", compress: str = "none"):
        super().__init__(model, groups, env, bucket_mb, mode=mode, compress=compress)
        self.group_of = {id(p): i for i, g in enumerate(groups) for p in g.params}
        for bucket in self.buckets:
            bucket.flat = bucket.buffer.new_zeros(bucket.buffer.numel())  # the parameters' values
            for p, view in zip(bucket.params, bucket.views(bucket.flat)):
                view.copy_(p.detach())
                p.data = view
            bucket.param_shard = torch.nn.Parameter(self._slice(bucket.flat))
            bucket.param_shard.grad = bucket.shard  # the reduce-scatter writes the gradient here
        self.owned = self._owned_views()

    def layout(self, group: Group) -> list[tuple[list[torch.nn.Parameter], list[int], int]]:
        """AdamW's groups as in rs-ag; Muon's by owner: per bucket of muon.plan, rank r's whole
        matrices in part r of the buffer, every part as large as the largest."""
        if group.kind != "muon":
            return super().layout(group)
        out = []
        for parts in self.matrices.layout.buckets:
            part = max(sum(group.params[i].numel() for i in mine) for mine in parts)
            params, offsets = [], []
            for rank, mine in enumerate(parts):
                params += [group.params[i] for i in mine]
                offsets += packed([group.params[i] for i in mine], rank * part)
            out.append((params, offsets, part * self.env.world_size))
        return out

    def _owned_views(self) -> list[torch.nn.Parameter]:
        """This rank's matrices as 2-D views of the flat buffers (in muon's `mine` order), their
        gradients views of this rank's reduce-scattered shard: what its Muon steps."""
        if self.matrices is None:
            return []
        where = {id(p): (b, o) for b in self.buckets for p, o in zip(b.params, b.offsets)}
        views = []
        for i in self.matrices.mine:
            p = self.whole[i]
            bucket, offset = where[id(p)]
            start = self.env.rank * bucket.shard.numel()
            view = torch.nn.Parameter(bucket.flat[offset:offset + p.numel()].view(p.shape))
            view.grad = bucket.shard[offset - start:offset - start + p.numel()].view(p.shape)
            views.append(view)
        return views

    def _slice(self, flat: torch.Tensor) -> torch.Tensor:
        n = flat.numel() // self.env.world_size
        return flat[self.env.rank * n:(self.env.rank + 1) * n]

    def params(self) -> list[list[torch.Tensor]]:
        """AdamW: this rank's slice of each of the group's buckets; Muon: its matrices."""
        out = [[] for _ in self.groups]
        for bucket in self.buckets:
            group = self.group_of[id(bucket.params[0])]
            if self.groups[group].kind != "muon":
                out[group].append(bucket.param_shard)
        for i, group in enumerate(self.groups):
            if group.kind == "muon":
                out[i] = self.owned
        return out

    def held(self) -> list[torch.Tensor]:
        return []  # only its own slices: no loss scaler here (see the mode table)

    def finish(self) -> None:
        """Rank r ends with the mean gradient of its slices (no all-gather of gradients)."""
        self._issue_the_rest()
        for bucket in self.buckets:
            self._land(bucket, bucket.wire_shard, bucket.shard)
        self.syncing = False

    def clip(self, max_norm: float) -> torch.Tensor:
        """The global gradient norm (squared slice norms summed over ranks; padding is zero), and
        the slices scaled as torch's clip_grad_norm_ scales whole gradients."""
        squares = torch.stack([b.shard.float().pow(2).sum() for b in self.buckets]).sum()
        norm = collectives.all_reduce(self.env, squares).sqrt()
        if math.isfinite(max_norm):
            coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
            for bucket in self.buckets:
                bucket.shard.mul_(coef.to(bucket.shard.dtype))
        return norm

    def after_update(self) -> None:
        """Every rank gets every rank's updated slices back: the whole model again."""
        works = [collectives.all_gather_async(self.env, b.flat, b.param_shard.detach().clone())
                 for b in self.buckets]
        with collective():
            for work in works:
                work.wait()

    # ---- AdamW's state, in the layout that does not depend on the mode ------------------------

    def _adamw_buckets(self) -> list[Bucket]:
        return [b for b in self.buckets if self.groups[self.group_of[id(b.params[0])]].kind
                == "adamw"]

    def _index(self) -> dict[int, int]:
        """Parameter -> its index in torch's AdamW over the whole model (groups in order)."""
        params = [p for g in self.groups if g.kind == "adamw" for p in g.params]
        return {id(p): i for i, p in enumerate(params)}

    def adamw_state(self, optimizer: Optimizer) -> dict:
        """Collective: the state_dict torch's AdamW over the whole model would have."""
        index, state = self._index(), {}
        for bucket in self._adamw_buckets():
            shard = optimizer.adamw.state.get(bucket.param_shard)
            if not shard:
                continue
            gathered = {}
            for key in MOMENTS:
                flat = bucket.flat.new_zeros(bucket.flat.numel())
                collectives.all_gather_async(self.env, flat, shard[key].contiguous()).wait()
                gathered[key] = bucket.views(flat)
            for i, p in enumerate(bucket.params):
                state[index[id(p)]] = {"step": shard["step"].clone(),
                                       **{key: gathered[key][i].clone() for key in MOMENTS}}
        groups = [g for g in self.groups if g.kind == "adamw"]
        hyper = optimizer.adamw.state_dict()["param_groups"]
        return {"state": state,
                "param_groups": [{**h, "params": [index[id(p)] for p in g.params]}
                                 for h, g in zip(hyper, groups)]}

    def load_adamw_state(self, optimizer: Optimizer, state: dict) -> None:
        """Slices the whole-model AdamW state (this run's hyperparameters stay)."""
        index = self._index()
        for bucket in self._adamw_buckets():
            saved = [state["state"].get(index[id(p)]) for p in bucket.params]
            if not saved[0]:
                continue
            shard = {"step": saved[0]["step"].clone()}
            for key in MOMENTS:
                flat = bucket.flat.new_zeros(bucket.flat.numel())
                for view, s in zip(bucket.views(flat), saved):
                    view.copy_(s[key])
                shard[key] = self._slice(flat).clone()
            optimizer.adamw.state[bucket.param_shard] = shard

    # ---- the sharded checkpoint: AdamW's moments as this rank's slices --------------------------

    def adamw_pieces(self, optimizer: Optimizer, create: bool) -> dict[str, Pieces]:
        """Each parameter's share of this rank's slice of its bucket: a range of its flattened
        elements (sharded.flat_range), views of the slice's moments."""
        out = {}
        for bucket in self._adamw_buckets():
            state = adamw_state(optimizer.adamw, bucket.param_shard, create)
            for p, start, end, first in self._overlaps(bucket) if state else ():
                for key in MOMENTS:
                    out[f"optimizer.adamw.{self.param_names[id(p)]}.{key}"] = flat_range(
                        p.shape, state[key][start:end], first)
        return out

    def _overlaps(self, bucket: Bucket) -> list[tuple[torch.nn.Parameter, int, int, int]]:
        """(parameter, start, end, first): the part [start, end) of this rank's slice that holds
        the parameter's flattened elements from `first` on."""
        n = bucket.shard.numel()
        begin = self.env.rank * n  # this rank's slice in the bucket's flat layout
        out = []
        for p, o in zip(bucket.params, bucket.offsets):
            lo, hi = max(o, begin), min(o + p.numel(), begin + n)
            if lo < hi:
                out.append((p, lo - begin, hi - begin, lo - o))
        return out

    def adamw_steps(self, optimizer: Optimizer) -> dict[str, float]:
        return {self.param_names[id(p)]: float(s["step"]) for b in self._adamw_buckets()
                if (s := optimizer.adamw.state.get(b.param_shard)) for p in b.params}

    def set_adamw_steps(self, optimizer: Optimizer, steps: dict[str, float]) -> None:
        for bucket in self._adamw_buckets():
            name = self.param_names[id(bucket.params[0])]
            if (s := optimizer.adamw.state.get(bucket.param_shard)) and name in steps:
                s["step"].fill_(steps[name])

    def memory(self, optimizer: Optimizer) -> dict[str, int]:
        held = super().memory(optimizer)  # the buffers: whole gradients and shards; the state
        held["params"] = nbytes(b.flat for b in self.buckets)  # the model: views of these
        return held

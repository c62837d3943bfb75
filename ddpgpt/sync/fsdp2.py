"""run.sync = fsdp2: parameters, gradients and optimizer state sharded, by torch's FSDP2.

`fully_shard` on each block and on the root turns every parameter into a DTensor holding 1/W of
its rows: a block's parameters are all-gathered just before its forward (and its backward) and
freed after, and its gradients are reduce-scattered, so each rank keeps and steps 1/W of
everything. On the first A-1 micro-steps the gradient reduce-scatter is skipped
(`set_requires_gradient_sync(False)`): gradients accumulate unsharded, as with DDP's no_sync.
AdamW steps the sharded parameters of its groups directly (it is elementwise).

Muon needs whole matrices (muon.py), and FSDP2 leaves each rank a band of rows of every matrix.
After clipping, one all-to-all sends every band of every matrix's weight and mean gradient to the
matrix's owner, which assembles them into its own whole copy (1/W of the matrices per rank, as
much as its shards); its torch Muon steps the copy, keeping the momentum of its matrices only;
a second all-to-all sends each band of the new weights back to the rank that holds it.

Why all-to-all rather than a gather and a scatter per matrix: each band travels once, straight to
its one destination, so a rank sends only its rows of the matrices others own, about
(W-1)/W² of the matrices' elements per pass: 1/W of an all-gather's bytes; and it is one
collective per direction rather than one per matrix (48 each way for gpt2-124m), which is what
costs on a latency-bound link. Measured with gloo on a 2-core VM, the tiny preset's 16 matrices
in FSDP2's bands, both directions (medians of 5 alternating rounds of 10): W=2 22.0 ms against
24.3 ms for a gather and a scatter per matrix, W=4 21.3 ms against 46.6 ms (a gather also pads
every band to the largest). Why the weights travel both ways rather than the update: the owner
runs torch's Muon step unchanged (decay, scaled update) on a whole matrix, so the shards receive
exactly the bits every other mode computes; the owner's copy is refreshed from the shards every
step, so nothing that writes the shards (a checkpoint load) can leave it stale.

The checkpoint does not see the mode: `model_state()` gathers full tensors
(torch.distributed.checkpoint.state_dict), and the optimizer state is gathered by hand into
torch's AdamW state_dict over the whole model (each moment's full_tensor) and Muon's over every
matrix (muon.Matrices); a state in that layout, whatever mode and W saved it, is cut back into
shards the same way. By hand because torch's get_optimizer_state_dict initializes the state of an
optimizer that has not stepped yet by stepping it with zero gradients: a checkpoint taken before
the first update would change the run.
"""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from ddpgpt.distributed import collectives
from ddpgpt.distributed.group import DistEnv, collective
from ddpgpt.optim.optimizer import Group, Optimizer
from ddpgpt.sync.base import MOMENTS, Sync, nbytes

FULL = StateDictOptions(full_state_dict=True)


def band(rows: int, world: int, rank: int) -> tuple[int, int]:
    """The rows [start, end) of a (rows, cols) parameter that FSDP2's Shard(0) gives `rank`:
    chunks of ceil(rows / W), the last ones short or empty."""
    chunk = -(-rows // world)
    return min(rows, rank * chunk), min(rows, (rank + 1) * chunk)


class FSDP2Sync(Sync):
    def __init__(self, model: torch.nn.Module, groups: list[Group], env: DistEnv,
                 bucket_mb: float, mode: str = "fsdp2", compress: str = "none"):
        super().__init__(model, groups, env, bucket_mb)
        self.name = mode
        self.names = [[self.param_names[id(p)] for p in g.params] for g in groups]
        self.mesh = init_device_mesh(env.device.type, (env.world_size,))
        for block in model.blocks:  # each block gathered and freed on its own
            fully_shard(block, mesh=self.mesh)
        fully_shard(model, mesh=self.mesh)  # the rest: embeddings (the tied head), the final norm
        sharded = dict(model.named_parameters())  # DTensors now; the whole ones are gone
        self.sharded = [[sharded[n] for n in names] for names in self.names]
        self.shards = next((s for g, s in zip(groups, self.sharded) if g.kind == "muon"), [])
        # this rank's whole copies of its matrices (refreshed from the bands every step)
        self.owned = [torch.nn.Parameter(torch.zeros(self.matrices.shapes[i], device=env.device,
                                                     dtype=self.matrices.dtype))
                      for i in self.matrices.mine] if self.matrices else []
        for i, p in enumerate(self.shards):  # our bands must be FSDP2's
            start, end = band(p.shape[0], env.world_size, env.rank)
            assert p.to_local().shape[0] == end - start, (i, p.to_local().shape, start, end)

    def params(self) -> list[list[torch.Tensor]]:
        """AdamW: the sharded parameters; Muon: this rank's whole copies of its matrices."""
        return [self.owned if g.kind == "muon" else s for g, s in zip(self.groups, self.sharded)]

    def held(self) -> list[torch.Tensor]:
        return []  # no loss scaler here (see the mode table)

    def micro_step(self, last: bool):
        self.model.set_requires_gradient_sync(last)  # reduce-scatter in the last backward only
        return super().micro_step(last)

    def clip(self, max_norm: float) -> torch.Tensor:
        grads = [p for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(grads, max_norm)  # over DTensors: a global norm
        return norm.full_tensor() if isinstance(norm, DTensor) else norm

    # ---- Muon: whole matrices to their owners and back ------------------------------------------

    def before_update(self) -> None:
        """Collective: each owner's copies get every band of its matrices' weights and (clipped)
        mean gradients."""
        if not self.matrices:
            return
        W, layout = self.env.world_size, self.matrices.layout
        pieces, sizes = [], []
        for owner in range(W):  # to each owner: my band of the weight, then of the gradient
            mine = [t.to_local() for i in layout.owned(owner)
                    for t in (self.shards[i], self.shards[i].grad)]
            pieces += mine
            sizes.append(sum(t.numel() for t in mine))
        sent = self._cat(pieces)
        received = sent.new_empty(sum(self._band_sizes(r, 2) for r in range(W)))
        collectives.all_to_all(self.env, received, sent,
                               [self._band_sizes(r, 2) for r in range(W)], sizes)
        offset = 0
        for copy in self.owned:  # freed again by zero_grad: none between steps
            copy.grad = torch.empty_like(copy)
        with torch.no_grad():
            for rank in range(W):
                for copy in self.owned:
                    start, end = band(copy.shape[0], W, rank)
                    n = (end - start) * copy.shape[1]
                    copy[start:end] = received[offset:offset + n].view(end - start, -1)
                    copy.grad[start:end] = received[offset + n:offset + 2 * n].view(end - start, -1)
                    offset += 2 * n

    def after_update(self) -> None:
        """Collective: each band of the owners' new weights back to the rank that holds it."""
        if not self.matrices:
            return
        W, layout = self.env.world_size, self.matrices.layout
        pieces, sizes = [], []
        for rank in range(W):  # to each rank: its band of every matrix I own
            mine = []
            for copy in self.owned:
                start, end = band(copy.shape[0], W, rank)
                mine.append(copy.detach()[start:end])
            pieces += mine
            sizes.append(sum(t.numel() for t in mine))
        sent = self._cat(pieces)
        splits = [sum(self.shards[i].to_local().numel() for i in layout.owned(r))
                  for r in range(W)]
        received = sent.new_empty(sum(splits))
        collectives.all_to_all(self.env, received, sent, splits, sizes)
        offset = 0
        with torch.no_grad():
            for owner in range(W):
                for i in layout.owned(owner):
                    local = self.shards[i].to_local()
                    local.copy_(received[offset:offset + local.numel()].view_as(local))
                    offset += local.numel()

    def _band_sizes(self, rank: int, per: int) -> int:
        """Elements `rank` sends me: its band of each matrix I own, `per` tensors each."""
        total = 0
        for copy in self.owned:
            start, end = band(copy.shape[0], self.env.world_size, rank)
            total += per * (end - start) * copy.shape[1]
        return total

    def _cat(self, pieces: list[torch.Tensor]) -> torch.Tensor:
        flat = [t.reshape(-1) for t in pieces]
        return torch.cat(flat) if flat else torch.zeros(0, device=self.env.device)

    def zero_grad(self) -> None:
        for p in [*self.model.parameters(), *self.owned]:
            p.grad = None

    # ---- state, in the layout that does not depend on the mode --------------------------------

    def model_state(self) -> dict:
        with collective():
            return get_model_state_dict(self.model, options=FULL)

    def load_model_state(self, state: dict) -> None:
        """Collective: each tensor is scattered from rank 0 in the order of `state`, so every rank
        must list them alike: in the model's order (safetensors returns a file's tensors in an
        order of its own in each process)."""
        order = [n for n, _ in self.model.named_parameters()]
        state = {n: state[n] for n in order if n in state} | {k: v for k, v in state.items()
                                                              if k not in order}
        with collective():
            set_model_state_dict(self.model, state, options=FULL)

    def _adamw(self) -> list[torch.Tensor]:
        """torch's AdamW over the whole model indexes these, in this order."""
        return [p for _, p in self.adamw_named()]

    def adamw_state(self, optimizer: Optimizer) -> dict:
        """Collective (when there is state): every moment's full tensor, same order on every
        rank. Nothing is asked of an optimizer that has not stepped."""
        state = {}
        for i, p in enumerate(self._adamw()):
            saved = optimizer.adamw.state.get(p)
            if saved:
                with collective():
                    state[i] = {"step": saved["step"].clone(),
                                **{k: saved[k].full_tensor() for k in MOMENTS}}
        groups = optimizer.adamw.state_dict()["param_groups"]  # indices in this order already
        return {"state": state, "param_groups": groups}

    def load_adamw_state(self, optimizer: Optimizer, state: dict) -> None:
        for i, p in enumerate(self._adamw()):
            saved = state["state"].get(i)
            if saved:
                optimizer.adamw.state[p] = {
                    "step": saved["step"].clone(),
                    **{k: distribute_tensor(saved[k].to(p.device), self.mesh, p.placements,
                                            src_data_rank=None) for k in MOMENTS}}

    # ---- the sharded checkpoint: DTensors write and read their local shards ----------------------

    def adamw_named(self) -> list[tuple[str, torch.Tensor]]:
        return [(n, p) for g, names, sharded in zip(self.groups, self.names, self.sharded)
                if g.kind == "adamw" for n, p in zip(names, sharded)]

    def memory(self, optimizer: Optimizer) -> dict[str, int]:
        held = super().memory(optimizer)
        held["params"] += nbytes(self.owned)  # the owners' whole copies and their gradients
        held["grads"] += nbytes(c.grad for c in self.owned)
        return held

    def local_elements(self, optimizer: Optimizer) -> dict:
        """Elements this rank holds: parameters and optimizer state (for tests and bench)."""
        params = sum(p.to_local().numel() for p in self.model.parameters())
        state = sum(v.to_local().numel() if isinstance(v, DTensor) else v.numel()
                    for s in optimizer.state.values() for v in s.values()
                    if torch.is_tensor(v) and v.dim() > 0)
        return {"params": params, "state": state}

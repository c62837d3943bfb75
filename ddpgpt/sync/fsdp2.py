"""run.sync = fsdp2: parameters, gradients and optimizer state sharded, by torch's FSDP2.

`fully_shard` on each block and on the root turns every parameter into a DTensor holding 1/W of
it: a block's parameters are all-gathered just before its forward (and its backward) and freed
after, and its gradients are reduce-scattered, so each rank keeps and steps 1/W of everything.
On the first A-1 micro-steps the gradient reduce-scatter is skipped
(`set_requires_gradient_sync(False)`): gradients accumulate unsharded, as with DDP's no_sync.

The optimizer is built again over the sharded parameters, and the checkpoint does not see the
mode: `model_state()` and `optimizer_state()` gather full tensors
(torch.distributed.checkpoint.state_dict) and the optimizer state is re-keyed from parameter
names to the indices of torch's AdamW over the whole model; a state in that layout, whatever mode
and W saved it, is loaded into the sharded optimizer the same way back.
"""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from ddpgpt import dist
from ddpgpt.sync import Sync

FULL = StateDictOptions(full_state_dict=True)


class FSDP2Sync(Sync):
    def __init__(self, model: torch.nn.Module, env: dist.DistEnv, optimizer: torch.optim.Optimizer):
        names = {id(p): n for n, p in model.named_parameters()}
        # The whole-model layout: parameter i of the optimizer's groups, in order, is names[i].
        self.names = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
        full_state = optimizer.state_dict()
        mesh = init_device_mesh(env.device.type, (env.world_size,))
        for block in model.blocks:  # each block gathered and freed on its own
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)  # the rest: embeddings (the tied head), the final norm
        params = dict(model.named_parameters())
        groups = [{**{k: v for k, v in g.items() if k != "params"},
                   "params": [params[names[id(p)]] for p in g["params"]]}
                  for g in optimizer.param_groups]
        super().__init__(model, type(optimizer)(groups))
        if full_state["state"]:
            with dist.collective():
                set_optimizer_state_dict(model, self.optimizer, self._by_name(full_state),
                                         options=FULL)

    def micro_step(self, last: bool):
        self.model.set_requires_gradient_sync(last)  # reduce-scatter in the last backward only
        return super().micro_step(last)

    def clip(self, max_norm: float) -> torch.Tensor:
        norm = super().clip(max_norm)  # over DTensor gradients: a global norm, as a DTensor
        return norm.full_tensor() if isinstance(norm, DTensor) else norm

    def model_state(self, raw: torch.nn.Module) -> dict:
        with dist.collective():
            return get_model_state_dict(self.model, options=FULL)

    def optimizer_state(self) -> dict:
        """Collective. An optimizer that has not stepped yet (a checkpoint before the first
        update, e.g. after a skipped non-finite step) has no state to gather, and torch's
        get_optimizer_state_dict would create one by running a step with zero gradients: the live
        optimizer would count a step that never happened and make its first real update smaller.
        Its layout is returned without asking torch."""
        if not self.optimizer.state:
            groups = self.optimizer.state_dict()["param_groups"]  # indices over our groups
            return {"state": {}, "param_groups": groups}
        with dist.collective():
            state = get_optimizer_state_dict(self.model, self.optimizer, options=FULL)
        index = {name: i for i, name in enumerate(self.names)}
        return {"state": {index[n]: s for n, s in state["state"].items()},
                "param_groups": [{**g, "params": [index[n] for n in g["params"]]}
                                 for g in state["param_groups"]]}

    def _by_name(self, state: dict) -> dict:
        """torch's AdamW layout (parameter indices) -> torch.distributed.checkpoint's (names)."""
        return {"state": {self.names[i]: s for i, s in state["state"].items()},
                "param_groups": [{**g, "params": [self.names[i] for i in g["params"]]}
                                 for g in state["param_groups"]]}

    def local_elements(self) -> dict:
        """Elements this rank holds: parameters and optimizer state (for tests and bench)."""
        params = sum(p.to_local().numel() for p in self.model.parameters())
        state = sum(v.to_local().numel() if isinstance(v, DTensor) else v.numel()
                    for s in self.optimizer.state.values() for v in s.values()
                    if torch.is_tensor(v) and v.dim() > 0)
        return {"params": params, "state": state}

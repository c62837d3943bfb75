"""The Sync interface, as the model alone runs it (world size 1, or bench's no-collective
baseline), and `Replicated`: what every mode that keeps the whole model and its whole mean
gradient on every rank (ddp, allreduce, rs-ag) adds to it for Muon.

Every rank holds the whole model. AdamW steps every parameter of its groups on every rank; Muon's
matrices are stepped by their owners only (muon.py), each keeping the momentum of its own. Where
the gradients are replicated, the owners' new weights then travel in one all_gather. The
checkpoint layout does not depend on any of this: torch's AdamW state_dict over the whole model
for adamw, and for muon {"muon": torch's Muon state_dict over every matrix, "adamw": torch's AdamW
state_dict over the rest}.
"""

from __future__ import annotations

import contextlib
import importlib

import torch

from ddpgpt.checkpoint.sharded import Pieces, of_dtensor, whole
from ddpgpt.distributed.group import DistEnv
from ddpgpt.optim.muon import Matrices
from ddpgpt.optim.optimizer import Group, Optimizer, load_state
from ddpgpt.sync.modes import MODES, check


class Sync:
    """What every mode does unless it says otherwise: no collective at all."""

    def __init__(self, model: torch.nn.Module, groups: list[Group], env: DistEnv,
                 bucket_mb: float = 25.0):
        self.raw = self.model = model  # the single-device model; what runs the forward
        self.groups, self.env = groups, env
        self.param_names = {id(p): n for n, p in model.named_parameters()}  # before any sharding
        muon = [g.params for g in groups if g.kind == "muon"]
        bucket_elems = int(bucket_mb * 2**20) // 4
        # Muon's matrices, whole, in model order (the mode may shard the model's own later)
        self.whole = muon[0] if muon else []
        self.matrices = Matrices(self.whole, env, bucket_elems) if muon else None

    # ---- what this rank steps ------------------------------------------------------------------

    def params(self) -> list[list[torch.Tensor]]:
        """Per group: the tensors this rank's optimizer steps (whole parameters; Muon's: the
        matrices this rank owns)."""
        return [[g.params[i] for i in self.matrices.mine] if g.kind == "muon" else list(g.params)
                for g in self.groups]

    def held(self) -> list[torch.Tensor]:
        """Gradients this rank holds but another rank steps: the matrices owned elsewhere."""
        if self.matrices is None:
            return []
        mine = set(self.matrices.mine)
        return [p for i, p in enumerate(self.whole) if i not in mine]

    # ---- the step ---------------------------------------------------------------------------

    def micro_step(self, last: bool):
        return contextlib.nullcontext()

    def finish(self) -> None:
        pass

    def clip(self, max_norm: float) -> torch.Tensor:
        """Every rank holds the whole mean gradient: this is the global norm (summed group by
        group, the order the float sum has always been taken in)."""
        grads = [p for g in self.groups for p in g.params if p.grad is not None]
        return torch.nn.utils.clip_grad_norm_(grads, max_norm)

    def before_update(self) -> None:
        pass

    def after_update(self) -> None:
        pass

    def zero_grad(self) -> None:
        for p in self.raw.parameters():
            p.grad = None

    # ---- state, in the layout that does not depend on the mode or W -------------------------

    def model_state(self) -> dict:
        """The whole single-device model's weights (collective for the sharded modes)."""
        return self.raw.state_dict()

    def load_model_state(self, state: dict) -> None:
        self.raw.load_state_dict(state)

    def optimizer_state(self, optimizer: Optimizer) -> dict:
        """Collective under Muon (the owners' momentum buffers travel)."""
        adamw = self.adamw_state(optimizer)
        if optimizer.muon is None:
            return adamw
        return {"muon": self.matrices.full_state(optimizer.muon, optimizer.matrices),
                "adamw": adamw}

    def load_optimizer_state(self, optimizer: Optimizer, state: dict) -> None:
        """A state in the layout above, whatever mode and W saved it; this run's hyperparameters
        (see optim.load_state)."""
        if optimizer.muon is None:
            self.load_adamw_state(optimizer, state)
            return
        self.load_adamw_state(optimizer, state["adamw"])
        self.matrices.load_state(optimizer.muon, optimizer.matrices, state["muon"])

    def adamw_state(self, optimizer: Optimizer) -> dict:
        """torch's AdamW state_dict over the whole model: here, AdamW's own."""
        return optimizer.adamw.state_dict()

    def load_adamw_state(self, optimizer: Optimizer, state: dict) -> None:
        load_state(optimizer.adamw, state)

    # ---- the sharded checkpoint: what this rank holds, as chunks of the logical tensors -------

    def checkpoint_state(self, optimizer: Optimizer, create: tuple[str, ...] = ()
                         ) -> tuple[dict[str, Pieces], set[str]]:
        """Every tensor of the checkpoint this rank holds, as Pieces of the single-device model's
        tensors named as in sharded.py (views: no copy, no collective), and the names of those that
        every rank holds alike (written by one rank). `create` ("adamw", "muon"): first make the
        optimizer state that does not exist yet, zeros, to load a checkpoint into."""
        held = {f"model.{n}": pieces(p.detach()) for n, p in self.raw.named_parameters()}
        adamw = self.adamw_pieces(optimizer, "adamw" in create)
        replicated = set() if self.shards_model else set(held)
        replicated |= set() if self.shards_adamw else set(adamw)
        return {**held, **adamw, **self.muon_pieces(optimizer, "muon" in create)}, replicated

    name: str | None = None  # the row of sync.MODES this runs (None: the model alone)

    @property
    def shards_model(self) -> bool:
        """Each rank holds 1/W of the weights, as the mode declares (else all of them, alike)."""
        return self.name is not None and MODES[self.name].shards_params

    @property
    def shards_adamw(self) -> bool:
        """Each rank holds 1/W of AdamW's state (else all of it, alike)."""
        return self.name is not None and MODES[self.name].shards_state

    def adamw_named(self) -> list[tuple[str, torch.Tensor]]:
        """(name, tensor AdamW steps) per parameter of the whole model's AdamW, in its order."""
        return [(self.param_names[id(p)], p) for g in self.groups if g.kind == "adamw"
                for p in g.params]

    def adamw_pieces(self, optimizer: Optimizer, create: bool) -> dict[str, Pieces]:
        out = {}
        for name, p in self.adamw_named():
            state = adamw_state(optimizer.adamw, p, create)
            for key in MOMENTS if state else ():
                out[f"optimizer.adamw.{name}.{key}"] = pieces(state[key])
        return out

    def adamw_steps(self, optimizer: Optimizer) -> dict[str, float]:
        """AdamW's step count per parameter name, of the parameters this rank has state for."""
        return {name: float(s["step"]) for name, p in self.adamw_named()
                if (s := optimizer.adamw.state.get(p))}

    def set_adamw_steps(self, optimizer: Optimizer, steps: dict[str, float]) -> None:
        for name, p in self.adamw_named():
            if (s := optimizer.adamw.state.get(p)) and name in steps:
                s["step"].fill_(steps[name])

    def muon_pieces(self, optimizer: Optimizer, create: bool) -> dict[str, Pieces]:
        """The momentum of this rank's matrices: whole, its own (any mode)."""
        if optimizer.muon is None:
            return {}
        out = {}
        for i, p in zip(self.matrices.mine, optimizer.matrices):
            state = optimizer.muon.state.get(p)
            if not state and create:
                state = optimizer.muon.state[p] = {"momentum_buffer": torch.zeros_like(p)}
            if state:
                name = self.param_names[id(self.whole[i])]
                out[f"optimizer.muon.{name}.momentum_buffer"] = whole(state["momentum_buffer"])
        return out

    def optimizer_rest(self, optimizer: Optimizer) -> dict:
        """The optimizer's part of a checkpoint that is not its tensors: the hyperparameters of
        each group of the whole model (parameters by name) and AdamW's step counts."""
        out = {}
        for kind, opt in (("muon", optimizer.muon), ("adamw", optimizer.adamw)):
            if opt is None:
                continue
            groups = [g for g in self.groups if g.kind == kind]
            out[kind] = {"param_groups": [
                {**{k: v for k, v in hyper.items() if k != "params"},
                 "params": [self.param_names[id(p)] for p in g.params]}
                for hyper, g in zip(opt.param_groups, groups)]}
        out["adamw"]["step"] = self.adamw_steps(optimizer)
        return out

    # ---- accounting, and the end ------------------------------------------------------------

    def memory(self, optimizer: Optimizer) -> dict[str, int]:
        """Bytes this rank holds for the parameters, their gradients and the optimizer state
        (and, under Muon, how much of that state is Muon's momentum)."""
        params = list(self.raw.parameters())
        held = {"params": nbytes(params), "grads": nbytes(p.grad for p in params),
                "state": nbytes(v for s in optimizer.state.values() for v in s.values())}
        if optimizer.muon is not None:
            held["muon_state"] = nbytes(s["momentum_buffer"]
                                        for s in optimizer.muon.state.values())
        return held

    def close(self) -> None:
        pass


class Replicated(Sync):
    """The modes that leave the whole mean gradient on every rank: each owner steps its matrices
    with the gradient it already holds, and one all_gather hands every rank the new weights."""

    def after_update(self) -> None:
        if self.matrices is not None:
            self.matrices.share(self.whole)


def nbytes(tensors) -> int:
    """Bytes of the tensors (a DTensor's local shard; scalars such as AdamW's step excluded)."""
    total = 0
    for t in tensors:
        if torch.is_tensor(t) and t.dim() > 0:
            t = t.to_local() if hasattr(t, "to_local") else t
            total += t.numel() * t.element_size()
    return total


MOMENTS = ("exp_avg", "exp_avg_sq")


def adamw_state(adamw: torch.optim.AdamW, p: torch.Tensor, create: bool) -> dict | None:
    """torch's AdamW state of `p`; with `create`, made as AdamW's first step makes it (zeros, the
    step count where AdamW keeps it) when there is none."""
    state = adamw.state.get(p)
    if state or not create:
        return state
    group = next(g for g in adamw.param_groups if any(q is p for q in g["params"]))
    on_device = group.get("fused") or group.get("capturable")
    step = torch.zeros((), dtype=torch.float32, device=p.device if on_device else "cpu")
    state = adamw.state[p] = {"step": step, **{k: torch.zeros_like(p) for k in MOMENTS}}
    return state


def pieces(t: torch.Tensor) -> Pieces:
    """A tensor as the chunks this rank holds: a DTensor's local shard, else all of it."""
    return of_dtensor(t) if hasattr(t, "device_mesh") else whole(t)


def make_sync(mode: str, model, groups: list, env, bucket_mb: float = 25.0, compress: str = "none"):
    """The Sync of `mode` around the single-device `model`, which it wraps and lays out for
    `groups` (optim.groups: the optimizer's parameter groups over the whole model). mode=None, or
    no process group: the model alone, no collective. `compress` bf16: gradients travel in
    bfloat16 (they still accumulate in fp32)."""
    if mode is not None:
        check(mode)
    if mode is None or env.backend is None:
        return Sync(model, groups, env, bucket_mb)
    module, name = MODES[mode].impl.split(":")
    cls = getattr(importlib.import_module(module), name)
    return cls(model, groups, env, bucket_mb, mode=mode, compress=compress)

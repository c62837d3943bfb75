"""The optimizer: torch's AdamW, or torch's Muon for the blocks' matrices with torch's AdamW for the
rest (optim/muon.py). The learning-rate schedule is optim/schedule.py's.

Built in one direction (trainer.py): the whole model's parameter groups (`groups`) go to the sync
mode, which lays the parameters out as it needs (whole, zero1's slices, fsdp2's shards, Muon
matrices by owner) and says what this rank steps of each group; `Optimizer` is then built over
exactly those tensors. Nothing is rebuilt or swapped afterwards.

A resumed run keeps the optimizer's state (moments, momentum buffers, step counts) but takes its
hyperparameters (weight decay, betas, eps, Muon's lr scale and Newton-Schulz steps) from this
run's config, not from the saved param_groups: a setting changed on resume is applied, and
metrics.jsonl records the change.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ddpgpt.config.optim import OptimConfig
from ddpgpt.errors import UserError
from ddpgpt.optim.muon import Muon


@dataclass
class Group:
    """One parameter group of the whole single-device model."""
    kind: str                              # "adamw" or "muon"
    params: list[torch.nn.Parameter]       # in model order
    weight_decay: float
    lr_scale: float = 1.0                  # the group's lr over optim.lr (Muon: muon_lr / lr)


# The token embedding's parameter (model/gpt.py), the one optim.embed_lr steps.
EMBEDDING = "wte.weight"


def is_muon_param(name: str, p: torch.nn.Parameter) -> bool:
    """The blocks' 2-D weight matrices: a linear map whose directions Muon equalizes. Embedding
    rows are lookups, the output head (tied to the embedding or not, as modded-nanogpt and
    nanochat keep it) maps into the vocabulary's logits, and vectors (gains, biases) have no
    singular values: those keep AdamW."""
    return name.startswith("blocks.") and p.dim() == 2


def groups(model: torch.nn.Module, cfg: OptimConfig) -> list[Group]:
    """adamw: matrices, embeddings and the head (dim >= 2) decay, biases and norm gains do not;
    with optim.embed_lr the token embedding is a third group, decayed, at its own lr. muon: the
    blocks' matrices first, then AdamW's groups over the rest."""
    muon, decay, no_decay, embed = [], [], [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if cfg.name == "muon" and is_muon_param(name, p):
            muon.append(p)
        elif cfg.embed_lr and name == EMBEDDING:
            embed.append(p)
        else:
            (decay if p.dim() >= 2 else no_decay).append(p)
    adamw = [Group("adamw", decay, cfg.weight_decay), Group("adamw", no_decay, 0.0)]
    if embed:
        adamw.append(Group("adamw", embed, cfg.weight_decay, cfg.embed_lr / cfg.lr))
    if cfg.name != "muon":
        return adamw
    return [Group("muon", muon, cfg.weight_decay, cfg.muon_lr / cfg.lr), *adamw]


class Optimizer:
    """What the trainer steps: torch's AdamW over this rank's share of the AdamW groups and, for
    muon, torch's Muon over the matrices this rank owns, as one object (set_lr, the loss scaler).
    `ns_dtype`: Muon's Newton-Schulz dtype (float32 under run.precision fp32, see muon.py).

    `params[i]`: the tensors this rank steps for `groups[i]`, as the sync mode laid them out.
    `held`: gradients this rank holds but another rank steps (the matrices owned elsewhere, where
    the mode replicates gradients): in `param_groups` with nothing to step, so that fp16's loss
    scaler unscales and checks every gradient a rank holds and all ranks skip a step alike."""

    def __init__(self, groups: list[Group], params: list[list[torch.Tensor]], cfg: OptimConfig,
                 device: torch.device, held: list[torch.Tensor] = (),
                 ns_dtype: torch.dtype = torch.bfloat16):
        # torch's fused kernel, where it has one (CUDA; CPU since torch 2.4): one pass over each
        # tensor, where foreach's list of ops takes ~6x its time on a CPU (3.2M parameters:
        # 2.2 ms against 14.2 ms a step, docs/performance.md "The step").
        fast = {"fused": True} if device.type in fused_devices() else {"foreach": True}
        self.adamw = torch.optim.AdamW(
            [{"params": p, "weight_decay": g.weight_decay, "lr_scale": g.lr_scale,
              "kind": "adamw"} for g, p in zip(groups, params) if g.kind == "adamw"],
            lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, **fast)
        muon = [(g, p) for g, p in zip(groups, params) if g.kind == "muon"]
        self.muon = Muon(
            [{"params": p, "weight_decay": g.weight_decay, "lr_scale": g.lr_scale,
              "kind": "muon"} for g, p in muon],
            lr=cfg.muon_lr, momentum=cfg.muon_momentum, ns_steps=cfg.muon_ns_steps,
            adjust_lr_fn="match_rms_adamw", ns_dtype=ns_dtype, ns=cfg.muon_ns, eq=cfg.muon_eq,
            snap=cfg.muon_snap) if muon else None
        self.matrices = [t for _, p in muon for t in p]  # what Muon steps (Matrices.mine order)
        self.held = [{"params": list(held), "kind": "held", "lr": 0.0}] if held else []

    @property
    def param_groups(self) -> list[dict]:
        """Both optimizers' groups as they are now (torch's load_state_dict replaces the dicts,
        so a list taken once would leave set_lr writing into the old ones)."""
        return [*(self.muon.param_groups if self.muon else []), *self.adamw.param_groups,
                *self.held]

    def step(self) -> None:
        self.adamw.step()
        if self.muon is not None:
            self.muon.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.adamw.zero_grad(set_to_none)
        if self.muon is not None:
            self.muon.zero_grad(set_to_none)

    def state_dict(self) -> dict:
        """This rank's state as it holds it (the sync mode turns it into the checkpoint's
        layout): AdamW's state_dict, or {"muon": Muon's, "adamw": AdamW's}."""
        if self.muon is None:
            return self.adamw.state_dict()
        return {"muon": self.muon.state_dict(), "adamw": self.adamw.state_dict()}

    @property
    def state(self) -> dict:
        """Every tensor's state, both optimizers (for counting memory)."""
        return {**self.adamw.state, **(self.muon.state if self.muon else {})}


def fused_devices() -> tuple[str, ...]:
    """The device types torch's fused AdamW runs on (its own list; CUDA where it has none)."""
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices
    except ImportError:
        return ("cuda",)
    return tuple(_get_fused_kernels_supported_devices())


def load_state(optimizer: torch.optim.Optimizer, state: dict) -> None:
    """A saved optimizer state, with this run's hyperparameters: torch's load_state_dict also
    restores the saved param_groups, which would silently undo a setting changed on resume."""
    configured = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    optimizer.load_state_dict(state)
    for group, hyper in zip(optimizer.param_groups, configured):
        group.update(hyper)


def check_groups(optimizer: Optimizer, state: dict, where: str) -> None:
    """A whole saved state (formats 1-2: torch's state_dict, the parameters numbered through
    their groups) fits only AdamW's groups as they were: optim.embed_lr set or unset since gives
    the token embedding a group of its own or takes it back. One line, not torch's error. (Format
    3 names every tensor: it loads into either.)"""
    saved = len(state.get("adamw", state)["param_groups"])
    mine = len(optimizer.adamw.param_groups)
    if saved != mine:
        raise UserError(f"{where}: its AdamW state has {saved} parameter groups, this run's "
                        f"{mine}: optim.embed_lr, set or unset since, moves the token embedding "
                        "into a group of its own or back, which a checkpoint of format 1-2 cannot "
                        "follow; resume with the optim.embed_lr in its meta.json, and change it "
                        "from the next checkpoint on (format 3 follows it)")


def upgrade(state: dict) -> dict:
    """A muon checkpoint of the earlier layout (one optimizer: groups muon, decay, no_decay, the
    parameters numbered across all three) in today's: {"muon": torch's Muon state_dict over the
    matrices, "adamw": torch's AdamW state_dict over the rest}. Anything else is returned as is."""
    groups = state.get("param_groups", [])
    if not groups or groups[0].get("kind") != "muon":
        return state
    k = len(groups[0]["params"])
    return {"muon": {"state": {i: s for i, s in state["state"].items() if i < k},
                     "param_groups": [{**groups[0], "params": list(range(k))}]},
            "adamw": {"state": {i - k: s for i, s in state["state"].items() if i >= k},
                      "param_groups": [{**g, "params": [i - k for i in g["params"]]}
                                       for g in groups[1:]]}}


def set_lr(optimizer, lr: float, momentum: float | None = None) -> None:
    """Every group's lr (times its lr_scale: Muon's lr over AdamW's), and Muon's momentum."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)
        if momentum is not None and group.get("kind") == "muon":
            group["momentum"] = momentum

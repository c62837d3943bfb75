"""Muon for the blocks' weight matrices, AdamW for everything else: one optimizer object.

Which parameters. Muon takes the 2-D matrices inside the transformer blocks (attention qkv and
projection, MLP in and out): their update is a linear map whose useful directions Adam's
per-element scaling cannot see. The token embedding (also the tied output head), the position
embedding, LayerNorm gains and biases stay with AdamW: an embedding row is a lookup, not a map,
and a vector has no singular values to equalize.

Muon's update of a matrix W with gradient G, momentum m (~0.95):

    B <- m·B + (1 - m)·G                  momentum buffer
    U <- (1 - m)·G + m·B                  Nesterov: a step further along the buffer
    O <- newton_schulz(U)                 ~ U·Vᵀ of U's SVD: every direction the same size
    W <- W·(1 - lr·wd) - lr·0.2·sqrt(max(rows, cols))·O

The scale 0.2·sqrt(max(rows, cols)) gives every update an RMS of 0.2, whatever the matrix's shape
(an orthogonal r×c matrix has RMS 1/sqrt(max(r, c))), about the RMS of an AdamW update, so
Muon's learning rate reads on AdamW's scale.

Distributed. Orthogonalizing is the expensive part (a few matmuls per matrix), so each rank does
only its share: matrix i belongs to one rank (`owners`: the largest matrices first, each to the
least loaded rank, ties to the lower rank and index: a function of the model and W alone). Each
rank packs its results into one flat buffer and a single all_gather hands every rank
every result, so all apply the same update. Every rank holds the same synced gradients (run.sync
ddp, allreduce or rs-ag), so the momentum buffers need no exchange. At W = 1 no collective.

The schedule stays a pure function of the step: the trainer sets each group's lr (AdamW's lr ×
the group's `lr_scale`) and Muon's momentum before every step.
"""

from __future__ import annotations

import math

import torch

from ddpgpt import dist
from ddpgpt.config import OptimConfig

# The quintic Newton-Schulz iteration X <- a·X + b·(XXᵀ)X + c·(XXᵀ)²X, with coefficients chosen to
# pull every singular value in (0, 1] fast towards 1 rather than to converge exactly.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
RMS = 0.2


def newton_schulz(g: torch.Tensor, steps: int = 5, dtype: torch.dtype = torch.float32
                  ) -> torch.Tensor:
    """U·f(S)·Vᵀ for g = U·S·Vᵀ, f(σ) close to 1 (see tests/unit/test_muon.py for the band), in
    `dtype` (bf16 on CUDA: the iteration tolerates it and runs at tensor-core speed)."""
    a, b, c = NS_COEFFICIENTS
    x = g.to(dtype)
    wide = x.size(0) <= x.size(1)
    if not wide:  # iterate on the smaller Gram matrix
        x = x.mT
    x = (x / (x.norm() + 1e-7)).contiguous()  # every singular value into (0, 1]
    for _ in range(steps):
        gram = x @ x.mT
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)  # b·gram + c·gram²
        x = torch.addmm(x, poly, x, beta=a)                     # a·x + poly·x
    return x if wide else x.mT


def owners(sizes: list[int], world: int) -> list[int]:
    """The rank that orthogonalizes each matrix: the largest first, each to the least loaded rank
    (ties: the lower rank; equal sizes keep their order)."""
    load, owner = [0] * world, [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        rank = min(range(world), key=lambda r: (load[r], r))
        owner[i], load[rank] = rank, load[rank] + sizes[i]
    return owner


def is_muon_param(name: str, p: torch.nn.Parameter) -> bool:
    return name.startswith("blocks.") and p.dim() == 2


class MuonAdamW(torch.optim.Optimizer):
    """Groups with kind "muon" step with Muon, the others with AdamW (torch's AdamW arithmetic,
    per tensor). `env` says which rank orthogonalizes what; None: this process does all."""

    def __init__(self, groups: list[dict], cfg: OptimConfig, env: dist.DistEnv | None = None,
                 ns_dtype: torch.dtype = torch.float32):
        defaults = {"lr": cfg.lr, "lr_scale": 1.0, "weight_decay": 0.0, "kind": "adamw",
                    "betas": (cfg.beta1, cfg.beta2), "eps": cfg.eps,
                    "momentum": cfg.muon_momentum, "ns_steps": cfg.muon_ns_steps}
        super().__init__(groups, defaults)
        self.env, self.ns_dtype = env or dist.DistEnv(), ns_dtype

    @torch.no_grad()
    def step(self, closure=None):
        assert closure is None, "no closure: the trainer computes the gradients"
        matrices = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if group["kind"] == "muon":
                    matrices.append((p, group, self._momentum(p, group)))
                else:
                    self._adamw(p, group)
        for (p, group, _), update in zip(matrices, self._orthogonalized(matrices)):
            if group["weight_decay"]:
                p.mul_(1 - group["lr"] * group["weight_decay"])
            p.add_(update.to(p.dtype), alpha=-group["lr"] * RMS * math.sqrt(max(p.shape)))

    def _momentum(self, p: torch.Tensor, group: dict) -> torch.Tensor:
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p)
        buf, m = state["momentum_buffer"], group["momentum"]
        buf.lerp_(p.grad, 1 - m)
        return p.grad.lerp(buf, m)  # Nesterov

    def _orthogonalized(self, matrices: list) -> list[torch.Tensor]:
        """newton_schulz of every update, each computed on its owner, then shared by all."""
        env = self.env
        world, rank = env.world_size, env.rank
        sizes = [p.numel() for p, _, _ in matrices]
        owner = owners(sizes, world)
        done = {i: newton_schulz(u, group["ns_steps"], self.ns_dtype)
                for i, (_, group, u) in enumerate(matrices) if owner[i] == rank}
        if world == 1:
            return [done[i] for i in range(len(matrices))]
        mine = [i for i in range(len(matrices)) if owner[i] == rank]
        width = max(sum(s for s, o in zip(sizes, owner) if o == r) for r in range(world))
        flat = torch.zeros(width, dtype=self.ns_dtype, device=matrices[0][0].device)
        offset = 0
        for i in mine:
            flat[offset:offset + sizes[i]] = done[i].reshape(-1)
            offset += sizes[i]
        gathered = dist.all_gather(env, flat).view(-1)  # rank r's results at r·width
        out: list[torch.Tensor | None] = [None] * len(matrices)
        offsets = [r * width for r in range(world)]
        for i, (p, _, _) in enumerate(matrices):  # each rank's results in index order
            start = offsets[owner[i]]
            out[i] = gathered[start:start + sizes[i]].view(p.shape)
            offsets[owner[i]] += sizes[i]
        return out

    def _adamw(self, p: torch.Tensor, group: dict) -> None:
        state, grad = self.state[p], p.grad
        if not state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(p)
            state["exp_avg_sq"] = torch.zeros_like(p)
        state["step"] += 1
        step = state["step"].item()
        beta1, beta2 = group["betas"]
        lr = group["lr"]
        p.mul_(1 - lr * group["weight_decay"])
        state["exp_avg"].lerp_(grad, 1 - beta1)
        state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        denom = (state["exp_avg_sq"].sqrt() / math.sqrt(1 - beta2 ** step)).add_(group["eps"])
        p.addcdiv_(state["exp_avg"], denom, value=-lr / (1 - beta1 ** step))


def make_muon(model: torch.nn.Module, cfg: OptimConfig, env: dist.DistEnv | None,
              device: torch.device) -> MuonAdamW:
    """Three groups: Muon's matrices; AdamW's embeddings (decayed); AdamW's gains and biases."""
    muon, decay, no_decay = [], [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (muon if is_muon_param(name, p) else decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": muon, "kind": "muon", "lr_scale": cfg.muon_lr / cfg.lr,
               "weight_decay": cfg.weight_decay},
              {"params": decay, "weight_decay": cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    ns_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return MuonAdamW(groups, cfg, env, ns_dtype)


def momentum_at(step: int, cfg: OptimConfig) -> float:
    """Muon's momentum at optimizer step `step`: from muon_momentum_start to muon_momentum over
    muon_momentum_warmup steps, then constant."""
    if step >= cfg.muon_momentum_warmup:
        return cfg.muon_momentum
    frac = step / cfg.muon_momentum_warmup
    return cfg.muon_momentum_start + frac * (cfg.muon_momentum - cfg.muon_momentum_start)

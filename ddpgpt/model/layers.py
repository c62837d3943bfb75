"""The pieces a block is made of, one table each: the normalization (model.norm), the rotary turn
of queries and keys (model.rope) and the MLP (model.mlp). Each computes what its transformers
counterpart computes (LayerNorm and GELU as GPT-2; RMSNorm, rotate_half rotary and SwiGLU as
Llama and Qwen3), so that an exported model gives the same logits.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from ddpgpt.config.model import ModelConfig
from ddpgpt.model import fused

# ---- normalization ------------------------------------------------------------------------------


class RMSNorm(nn.RMSNorm):
    """torch's RMSNorm, computed in fp32 whatever the input (queries and keys arrive in bf16 under
    autocast) and returned in the input's dtype, as transformers' Qwen3RMSNorm does; with
    `compiled` (model.kernels), one compiled kernel each way where model/fused.py runs one."""

    compiled = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        eps = self.eps if self.eps is not None else torch.finfo(torch.float32).eps  # torch's
        return fused_norm_turn(self.compiled, "RMSNorm", x, self.weight, None, None, eps)


def rms_norm(x: torch.Tensor, gain: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x², last dim) + eps) · gain, in fp32, returned in x's dtype. `gain`: the
    last dim's (D,), or any shape that broadcasts against x's trailing dims (the queries' and
    keys' gains side by side, (heads, D)). On a CPU `_RMSNorm` (torch's rms_norm there is a chain
    of unfused passes, forward and backward: ~5x LayerNorm's time); elsewhere torch's."""
    if x.device.type == "cpu" and not torch.compiler.is_compiling():
        return _RMSNorm.apply(x, gain, eps)
    if gain.dim() == 1:
        return F.rms_norm(x.float(), gain.shape, gain, eps).type_as(x)
    return (F.rms_norm(x.float(), x.shape[-1:], None, eps) * gain).type_as(x)


class _RMSNorm(torch.autograd.Function):
    """RMSNorm with its backward written out: three passes over x forward, five back (torch's
    composite takes about twice that, each pass a fresh tensor). For y = x̂·g, x̂ = x·r, r =
    (mean(x²) + eps)^-1/2: dx = r·(dy·g - x̂·mean(dy·g·x̂)), dg = Σ dy·x̂ over the leading dims."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, gain: torch.Tensor, eps: float) -> torch.Tensor:
        xf = x.to(torch.promote_types(x.dtype, torch.float32))  # bf16 in fp32, fp64 as it is
        r = torch.linalg.vector_norm(xf, dim=-1, keepdim=True).square_().div_(x.size(-1))
        r = r.add_(eps).rsqrt_()  # (..., 1)
        ctx.save_for_backward(xf, r, gain)
        return (xf * r).mul_(gain).to(x.dtype)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        xf, r, gain = ctx.saved_tensors
        xhat = xf * r
        dg = None
        if ctx.needs_input_grad[1]:
            lead = xhat.dim() - gain.dim()
            dg = (dy * xhat).sum(dim=tuple(range(lead))).to(gain.dtype)
        dyg = dy.to(xf.dtype) * gain
        dot = torch.linalg.vecdot(dyg, xhat).unsqueeze_(-1).div_(xf.size(-1))  # mean(dy·g·x̂)
        dx = dyg.sub_(xhat.mul_(dot)).mul_(r)
        return dx.to(dy.dtype), dg, None


def norm(cfg: ModelConfig, dim: int) -> nn.Module:
    """model.norm over the last `dim` features: LayerNorm (with a shift when model.bias) or
    RMSNorm; both start as the identity's gain (ones, see GPT.init_weights)."""
    if cfg.norm == "rmsnorm":
        module = RMSNorm(dim, eps=cfg.norm_eps)
        module.compiled = cfg.kernels == "compiled"
        return module
    return nn.LayerNorm(dim, eps=cfg.norm_eps, bias=cfg.bias)


NORMS = (nn.LayerNorm, nn.RMSNorm)  # what init_weights sets to ones


# ---- rotary positions ---------------------------------------------------------------------------

def rotary(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, ...]:
    """cos and sin of every position's angles, (T, head_dim) in fp32: dimension pair i (i and
    i + head_dim/2, the rotate_half layout of Llama and Qwen3, not GPT-NeoX's interleaved pairs)
    turns by position · theta^(-2i/head_dim). Computed per forward: a few T·head_dim
    transcendentals, against the T·n_embd² of any one matmul, and no buffer to place, shard or
    save."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device,
                                             dtype=torch.float32) / head_dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]  # (T, head_dim / 2)
    angles = torch.cat([freqs, freqs], dim=-1)               # (T, head_dim)
    return angles.cos(), angles.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (..., D) turned by the angles of its positions (cos and sin broadcast against x: (T, D)
    for (B, H, T, D), (T, 1, D) for (B, T, H, D)); in the dtype x came in. `_Rotate`: no
    rotate_half copy (a negation and a cat) and a backward that is the same turn backwards;
    compiled, the formula half by half (the compiler fuses it, and traces no writes into views;
    inductor's loop over x·cos + rotate_half(x)·sin took twice its time on a CPU)."""
    if torch.compiler.is_compiling():
        half = x.size(-1) // 2
        x1, x2, c, s = x[..., :half], x[..., half:], cos[..., :half], sin[..., :half]
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).type_as(x)
    return _Rotate.apply(x, cos, sin)


def _turn(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x·cos + rotate_half(x)·sin, where rotate_half(x) = (-x₂, x₁) for the halves x₁, x₂ of the
    last dim: each half of the result written in place from the halves of x (cos and sin are the
    same on both halves, `rotary`). In fp32 (cos and sin's), returned in x's dtype."""
    half = x.size(-1) // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[..., :half], sin[..., :half]
    shape = torch.broadcast_shapes(x.shape, cos.shape)
    out = torch.empty(shape, dtype=torch.result_type(x, cos), device=x.device)
    torch.mul(x1, c, out=out[..., :half]).addcmul_(x2, s, value=-1)  # x₁·cos - x₂·sin
    torch.mul(x2, c, out=out[..., half:]).addcmul_(x1, s)            # x₂·cos + x₁·sin
    return out.to(x.dtype)


def norm_turn(x: torch.Tensor, gain: torch.Tensor | None, cos: torch.Tensor | None,
              sin: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm (`gain`, or None: none) then the rotary turn (cos and sin, or None: none): the
    formula model/fused.py compiles into one kernel each way (RMSNorm alone, and QK-norm with
    the turn over the queries and keys side by side)."""
    if gain is not None:
        x = rms_norm(x, gain, eps)
    return x if cos is None else rotate(x, cos, sin)


def fused_norm_turn(on: bool, name: str, x: torch.Tensor, gain: torch.Tensor | None,
                    cos: torch.Tensor | None, sin: torch.Tensor | None, eps: float) -> torch.Tensor:
    """norm_turn through model/fused.py's kernel `name` where it runs (`on`: model.kernels
    compiled), backward through norm_turn_grad's where a gain trains."""
    grad = norm_turn_grad if gain is not None and gain.requires_grad else None
    return fused.call(on, name, norm_turn, x, gain, cos, sin, eps, grad=grad)


def norm_turn_grad(x: torch.Tensor, gain: torch.Tensor, cos: torch.Tensor | None,
                   sin: torch.Tensor | None, eps: float, dy: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, None, None, None]:
    """norm_turn's gradients with a `gain`, written out for model/fused.py to compile: dx, and
    the gain's as partial sums over up to 64 runs of rows (runs, *gain.shape), which fused.py
    adds up. For y = turn(x̂·g), x̂ = x·r, r = (mean(x²) + eps)^-1/2, and dn the turn
    backwards of dy: dx = r·(dn·g - x̂·mean(dn·g·x̂)), dg = Σ dn·x̂ over the rows. The gain's sum
    is over the outer dims, which inductor's loop walks a column at a time across every row;
    summed block by block it streams the rows once instead (the step, docs/performance.md)."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    r = torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    dy = dy.to(xf.dtype)
    # Half by half (x̂'s halves, dn's, the gain's): the turn backwards is then a formula of dy's
    # halves that the compiler folds into each loop, where a turned tensor is written out whole.
    pieces = 2 if cos is not None else 1
    xh, dyh, gh = xf.chunk(pieces, -1), dy.chunk(pieces, -1), gain.chunk(pieces, -1)
    xh = [h * r for h in xh]
    if cos is not None:
        c, s = cos[..., :cos.size(-1) // 2], sin[..., :sin.size(-1) // 2]
        dyh = [dyh[0] * c + dyh[1] * s, dyh[1] * c - dyh[0] * s]  # turned by minus the angle
    dyg = [d * g for d, g in zip(dyh, gh)]
    dot = sum((d * h).sum(-1, keepdim=True) for d, h in zip(dyg, xh)) / x.size(-1)
    dx = torch.cat([r * (d - h * dot) for d, h in zip(dyg, xh)], -1)
    runs = math.gcd(dy.numel() // gain.numel(), 64)
    dg = torch.cat([(d * h).reshape(runs, -1, *g.shape).sum(1)
                    for d, h, g in zip(dyh, xh, gh)], -1)
    return dx.to(x.dtype), dg.to(gain.dtype), None, None, None


class _Rotate(torch.autograd.Function):
    """The rotary turn, a rotation of each pair (x₁ᵢ, x₂ᵢ) by its angle; the gradient is the
    rotation by minus that angle (cos and sin are constants: positions, not parameters)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        return _turn(x, cos, sin)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        cos, sin = ctx.saved_tensors
        return _turn(grad, cos, -sin), None, None


# ---- MLPs ---------------------------------------------------------------------------------------

class MLP(nn.Module):
    """Two matrices and an activation between them: gelu (GPT-2's; model.gelu picks the tanh
    approximation or erf) or relu2 (ReLU squared)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, cfg.mlp_hidden, bias=cfg.bias)
        self.proj = nn.Linear(cfg.mlp_hidden, cfg.n_embd, bias=cfg.bias)
        self.proj.residual = True  # scaled or zero init, see GPT.init_weights
        self.drop = nn.Dropout(cfg.dropout)
        self.relu2 = cfg.mlp == "relu2"
        self.approximate = "tanh" if cfg.gelu == "tanh" else "none"
        self.compiled = cfg.kernels == "compiled"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)  # (B, T, hidden)
        if self.relu2:
            h = fused.call(self.compiled, "ReLU²", relu2, h)
        else:
            h = F.gelu(h, approximate=self.approximate)
        return self.drop(self.proj(h))


def relu2(h: torch.Tensor) -> torch.Tensor:
    """ReLU squared: the formula model/fused.py compiles."""
    return F.relu(h).square()


class SwiGLU(nn.Module):
    """Llama's and Qwen3's MLP: proj(silu(gate(x)) · fc(x)), three matrices (gate_proj, up_proj,
    down_proj in transformers)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate = nn.Linear(cfg.n_embd, cfg.mlp_hidden, bias=cfg.bias)
        self.fc = nn.Linear(cfg.n_embd, cfg.mlp_hidden, bias=cfg.bias)
        self.proj = nn.Linear(cfg.mlp_hidden, cfg.n_embd, bias=cfg.bias)
        self.proj.residual = True
        self.drop = nn.Dropout(cfg.dropout)
        self.compiled = cfg.kernels == "compiled"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = fused.call(self.compiled, "SwiGLU", swiglu, self.gate(x), self.fc(x))
        return self.drop(self.proj(h))


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) · up: the formula model/fused.py compiles."""
    return F.silu(gate) * up


MLPS = {"gelu": MLP, "relu2": MLP, "swiglu": SwiGLU}  # model.mlp -> its module

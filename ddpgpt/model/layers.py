"""The pieces a block is made of, one table each: the normalization (model.norm), the rotary turn
of queries and keys (model.rope) and the MLP (model.mlp). Each computes what its transformers
counterpart computes (LayerNorm and GELU as GPT-2; RMSNorm, rotate_half rotary and SwiGLU as
Llama and Qwen3), so that an exported model gives the same logits.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ddpgpt.config.model import ModelConfig

# ---- normalization ------------------------------------------------------------------------------


class RMSNorm(nn.RMSNorm):
    """torch's RMSNorm, computed in fp32 whatever the input (queries and keys arrive in bf16 under
    autocast) and returned in the input's dtype, as transformers' Qwen3RMSNorm does."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.float()).type_as(x)


def norm(cfg: ModelConfig, dim: int) -> nn.Module:
    """model.norm over the last `dim` features: LayerNorm (with a shift when model.bias) or
    RMSNorm; both start as the identity's gain (ones, see GPT.init_weights)."""
    if cfg.norm == "rmsnorm":
        return RMSNorm(dim, eps=cfg.norm_eps)
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
    """x (B, H, T, D) turned by the angles of its positions; in the dtype x came in."""
    half = x.size(-1) // 2
    x1, x2 = x[..., :half], x[..., half:]
    turned = torch.cat([-x2, x1], dim=-1)  # rotate_half
    return (x * cos + turned * sin).type_as(x)


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)  # (B, T, hidden)
        h = F.relu(h).square() if self.relu2 else F.gelu(h, approximate=self.approximate)
        return self.drop(self.proj(h))


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.silu(self.gate(x)) * self.fc(x)))


MLPS = {"gelu": MLP, "relu2": MLP, "swiglu": SwiGLU}  # model.mlp -> its module

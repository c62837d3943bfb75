"""The decoder: token embedding, pre-norm blocks of causal self-attention and an MLP, a final norm
and the output head. Which pieces it is made of is the config's (model.arch and the pieces it
bundles, docs/model.md): GPT-2's learned positions, LayerNorm, GELU and tied head, or rotary
positions, RMSNorm, QK-norm, ReLU² or SwiGLU and an untied head, in any mix.

Initialization, drawn from a private generator seeded by the caller (the same seed gives
bit-identical weights on every rank and device), in module order:
- every matrix and embedding N(0, 0.02): GPT-2's, for the token and position embeddings, the
  attention and MLP input matrices, and an untied head alike, so that untying changes nothing but
  the tying;
- the residual (output) projections N(0, 0.02 / sqrt(2 · n_layer)), or with zero_init_proj zeros
  (drawn, then zeroed: the other matrices stay those of the same seed without it), so that every
  block starts as the identity and the first steps train the path through the embedding and head;
- biases zero, norm gains one.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from ddpgpt.config.model import ModelConfig
from ddpgpt.model import flex, fused
from ddpgpt.model.attention import CausalSelfAttention, KVCache, mask_for
from ddpgpt.model.generate import generate
from ddpgpt.model.layers import MLPS, NORMS, norm, rotary


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, reduction: str) -> torch.Tensor:
    """The loss of logits (B, T, V), in fp32, against targets (B, T) (-1: ignored). Compiled
    (model.kernels), one pass forward and one back, where eager writes the log-softmax whole and
    reads it again."""
    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1),
                           ignore_index=-1, reduction=reduction)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln1 = norm(cfg, cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = norm(cfg, cfg.n_embd)
        self.mlp = MLPS[cfg.mlp](cfg)

    def forward(self, x: torch.Tensor, angles=None, cache: KVCache | None = None,
                layer: int = 0, mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), angles, cache, layer, mask)
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig, seed: int = 0):
        super().__init__()
        if cfg.vocab_size < 1:
            raise ValueError("GPT needs a resolved vocab_size (the dataset's, see "
                             "preflight.resolve)")
        cfg = self.cfg = cfg.resolved()
        if cfg.doc_mask and cfg.bos_id < 0:
            raise ValueError("model.doc_mask needs a resolved bos_id (the dataset's end-of-text, "
                             "see preflight.resolve)")
        # The devices whose masks go through FlexAttention (model.attention, decided here once
        # for each: the model is built before it is moved).
        self.flex_on = frozenset(d for d in ("cpu", "cuda")
                                 if flex.choose(cfg.attention, d, cfg.dropout, cfg.block_size,
                                                cfg.doc_mask) == "flex")
        if self.flex_on and flex.unavailable():
            raise ValueError(f"model.attention = flex: {flex.unavailable()}, or use "
                             "model.attention sdpa (or auto)")
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = None if cfg.rope else nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = norm(cfg, cfg.n_embd)
        self.lm_head = (None if cfg.tie_embeddings
                        else nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False))
        self.compiled = cfg.kernels == "compiled"  # the cross-entropy's kernel: model/fused.py
        self.init_weights(seed)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """The init of the module docstring, from a private CPU generator: independent of the
        global RNG and the device."""
        gen = torch.Generator().manual_seed(seed)
        residual_std = 0.02 / math.sqrt(2 * self.cfg.n_layer)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                residual = getattr(module, "residual", False)
                std = residual_std if residual else 0.02
                module.weight.copy_(torch.randn(module.weight.shape, generator=gen) * std)
                if residual and self.cfg.zero_init_proj:
                    module.weight.zero_()
                if getattr(module, "bias", None) is not None:
                    module.bias.zero_()
            elif isinstance(module, NORMS):
                module.weight.fill_(1.0)
                if getattr(module, "bias", None) is not None:
                    module.bias.zero_()

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None,
                reduction: str = "mean", cache: KVCache | None = None,
                window: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
        """idx, targets: (B, T) int64. Returns logits (B, T, V) and, with targets, the cross-entropy
        (`reduction` mean or sum; targets of -1 are ignored). With a `cache`, idx continues the
        tokens it holds (positions from cache.length on), and their keys and values join it.
        `window` (rotary only): each token attends to its last `window` tokens at every layer,
        as with a sliding cache, and idx may be longer than block_size. With model.doc_mask (and
        no cache) a token attends only to its own document's tokens of the row."""
        B, T = idx.shape
        mask = mask_for(idx, self.cfg, idx.device.type in self.flex_on, cache is not None, window)
        past = cache.length if cache is not None else 0
        pos = torch.arange(past, past + T, device=idx.device)
        x, angles = self.wte(idx), None  # (B, T, C)
        if self.wpe is not None:  # learned positions end at block_size
            if window:
                raise ValueError("a sliding window needs rotary positions (model.rope)")
            if past + T > self.cfg.block_size:
                raise ValueError(f"sequence of {past + T} tokens exceeds block_size "
                                 f"{self.cfg.block_size}")
            x = x + self.wpe(pos)
        else:  # rotary: positions go on (a sliding cache), a window holds block_size
            if T > self.cfg.block_size and not window:
                raise ValueError(f"sequence of {T} tokens exceeds block_size "
                                 f"{self.cfg.block_size}")
            angles = rotary(pos, self.cfg.head_dim, self.cfg.rope_theta)  # (T, D) each
        x = self.drop(x)
        for i, block in enumerate(self.blocks):
            x = block(x, angles, cache, i, mask)
        x = self.ln_f(x)
        # (B, T, V): the head, or the embedding as the head
        logits = F.linear(x, self.wte.weight) if self.lm_head is None else self.lm_head(x)
        if self.cfg.logit_softcap:  # in fp32: tanh in bf16 would round the logits coarsely
            cap = self.cfg.logit_softcap
            logits = cap * torch.tanh(logits.float() / cap)
        if self.cfg.vocab_limit:
            # Padding rows never win: untrained rows at 0 would beat GPT-2's logits, which run
            # far below zero. -inf also keeps them out of the loss and its gradient.
            logits[..., self.cfg.vocab_limit:] = float("-inf")
        if targets is None:
            return logits, None
        loss = fused.call(self.compiled, "cross-entropy", cross_entropy, logits, targets,
                          reduction)
        return logits, loss

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameters; by default without those that do no matmul work: the position embedding,
        and the token embedding when the head is a matrix of its own (tied, it is the head)."""
        n = sum(p.numel() for p in self.parameters())
        if not non_embedding:
            return n
        if self.wpe is not None:
            n -= self.wpe.weight.numel()
        return n - (self.wte.weight.numel() if self.lm_head is not None else 0)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (forward + backward) at sequence length T:
        6·N for the weight matmuls (2 forward, 4 backward per multiply-add of N parameters), plus
        12·L·T·(n_head·head_dim) for attention (QKᵀ and AV: 2·T·n_head·head_dim each forward per
        layer, tripled for backward). The attention term counts the full T×T score matrix, as
        PaLM's MFU does, though causal kernels skip half of it."""
        cfg = self.cfg
        return 6 * self.num_params() + 12 * cfg.n_layer * seq_len * cfg.n_head * cfg.head_dim

    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: int | None = None, generator: torch.Generator | None = None,
                 vocab_size: int | None = None, use_cache: bool = True) -> torch.Tensor:
        """Appends `max_new_tokens` sampled tokens to each row of idx (B, T): model/generate.py."""
        return generate(self, idx, max_new_tokens, temperature, top_k, generator, vocab_size,
                        use_cache)

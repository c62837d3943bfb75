"""Causal self-attention (through `F.scaled_dot_product_attention`, which picks flash or
memory-efficient kernels where it can, FlexAttention under a block mask: model/flex.py, or in a
training step on a CPU with model.kernels compiled, by blocks: model/causal_cpu.py), with
grouped-query heads, QK-norm and rotary positions as the config says, the masks (documents in a
row, the sliding band), and the KV cache that generation keeps between tokens."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ddpgpt.config.model import ModelConfig
from ddpgpt.model import causal_cpu, flex
from ddpgpt.model.layers import RMSNorm, fused_norm_turn


class KVCache:
    """The keys and values of the tokens a sequence has seen, for every layer: (B, H_kv, max_len,
    D) each. Allocated on the first write, in the dtype the keys come in (autocast: bf16).

    `length` counts every token seen (the next token's position). A prompt fills it from empty,
    then one token at a time joins it. With `slide` (rotary positions: a key's turn depends on
    its own position only, and attention on the difference of positions) it holds the newest
    max_len: token i lives in slot i % max_len, each new token overwriting the oldest, and a
    prompt longer than max_len leaves its last max_len. Attention over the slots does not care
    about their order. Without `slide` a full cache refuses more."""

    def __init__(self, n_layer: int, max_len: int, slide: bool = False):
        self.max_len, self.length, self.slide = max_len, 0, slide
        self.k: list[torch.Tensor | None] = [None] * n_layer
        self.v: list[torch.Tensor | None] = [None] * n_layer

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Writes this step's keys and values (B, H_kv, T, D); returns every one held, (B, H_kv,
        held, D). `length` moves on once the last layer has written."""
        T, m = k.size(2), self.max_len
        if self.length and T > 1:
            raise ValueError("a KV cache takes a prompt when empty, then one token at a time")
        end = self.length + T
        if end > m and not self.slide:
            raise ValueError(f"KV cache holds {m} tokens; {end} would overflow it")
        if self.k[layer] is None:
            shape = (k.size(0), k.size(1), m, k.size(3))
            self.k[layer] = k.new_empty(shape)
            self.v[layer] = v.new_empty(shape)
        kept = min(T, m)  # a prompt longer than the cache leaves its last m
        slots = torch.arange(end - kept, end, device=k.device) % m
        self.k[layer].index_copy_(2, slots, k[:, :, T - kept:])
        self.v[layer].index_copy_(2, slots, v[:, :, T - kept:])
        if layer == len(self.k) - 1:
            self.length = end
        held = min(end, m)
        return self.k[layer][:, :, :held], self.v[layer][:, :, :held]


def band(T: int, window: int, device) -> torch.Tensor:
    """(T, T) bool, True where query i may attend key j: j <= i and i - j < window (each token
    sees its last `window` tokens, itself included: the sliding cache's rule)."""
    i = torch.arange(T, device=device)[:, None]
    j = torch.arange(T, device=device)[None, :]
    return (j <= i) & (i - j < window)


def documents(idx: torch.Tensor, bos_id: int, within: torch.Tensor | None = None
              ) -> torch.Tensor:
    """(B, 1, T, T): where query i may attend key j of its row: j <= i, no document starts (a
    bos_id token) in (j, i], and `within` (a (T, T) band) allows it. The segment of a token is the
    count of bos_id tokens up to it, so tokens before a row's first bos_id (a continuation) are a
    document of their own. Bool on CUDA; on a CPU additive (0 or -inf, fp32), which SDPA's CPU
    kernel takes at the cost of a causal mask, where a bool one costs ~10% more."""
    segment = torch.cumsum(idx == bos_id, dim=1)  # (B, T)
    T = idx.size(1)
    allowed = torch.ones(T, T, dtype=torch.bool, device=idx.device).tril()
    if within is not None:
        allowed = allowed & within
    allowed = ((segment[:, :, None] == segment[:, None, :]) & allowed)[:, None]
    if idx.device.type == "cuda":
        return allowed
    return torch.zeros(allowed.shape, device=idx.device).masked_fill_(~allowed, float("-inf"))


def mask_for(idx: torch.Tensor, cfg: ModelConfig, use_flex: bool, cached: bool, window: int):
    """The mask every layer of one forward shares, or None (causal): the band when `window`
    is shorter than the rows, and model.doc_mask's documents (not with a KV cache: a prompt is
    one context). A BlockMask (`use_flex`: model.attention flex on this device), else a dense
    mask (`band`, `documents`). On a CPU a batch with no document start past its rows' first
    tokens takes the causal path; on CUDA that test would wait for the device."""
    T = idx.size(1)
    window = window if window and T > window else 0
    docs = cfg.doc_mask and not cached and T > 1 and (
        idx.is_cuda or bool((idx[:, 1:] == cfg.bos_id).any()))
    if use_flex:
        return flex.block_mask(idx, cfg.bos_id if docs else None, window) if docs or window \
            else None
    mask = band(T, window, idx.device) if window else None
    return documents(idx, cfg.bos_id, mask) if docs else mask  # (B, 1, T, T) or (T, T)


class CausalSelfAttention(nn.Module):
    """One fused projection to queries, keys and values ([q | k | v] rows: GPT-2's c_attn
    layout, and Llama's q_proj, k_proj, v_proj stacked), n_head query heads sharing n_kv_head
    key/value heads, and the output projection."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_head, self.n_kv, self.head_dim = cfg.n_head, cfg.n_kv_head, cfg.head_dim
        self.dropout = cfg.dropout
        q, kv = cfg.n_head * cfg.head_dim, cfg.n_kv_head * cfg.head_dim
        self.sizes = (q, kv, kv)
        self.qkv = nn.Linear(cfg.n_embd, q + 2 * kv, bias=cfg.bias)
        if cfg.qk_norm:  # one gain per head dimension, shared by the heads (Qwen3's q_norm)
            self.q_norm = RMSNorm(cfg.head_dim, eps=cfg.norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, eps=cfg.norm_eps)
        self.qk_norm = cfg.qk_norm
        self.compiled = cfg.kernels == "compiled"
        self.proj = nn.Linear(q, cfg.n_embd, bias=cfg.bias)
        self.proj.residual = True  # scaled or zero init, see GPT.init_weights
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
                cache: KVCache | None = None, layer: int = 0,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """`mask`: a (T, T) band (`band`) or a (B, 1, T, T) document mask (`documents`), True
        where attention is allowed, or a BlockMask (`flex.block_mask`: FlexAttention), instead of
        the causal mask."""
        B, T, _ = x.shape
        H, H_kv, D = self.n_head, self.n_kv, self.head_dim
        qkv = self.qkv(x)  # (B, T, (H + 2·H_kv)·D)
        # Queries and keys side by side, (B, T, H + H_kv, D): QK-norm and the rotary turn go over
        # both in one pass each.
        qk, v = qkv.split([(H + H_kv) * D, H_kv * D], dim=2)  # split: its backward is one cat
        qk, v = qk.view(B, T, H + H_kv, D), v.view(B, T, H_kv, D)
        gains = cos = sin = None
        if self.qk_norm:  # per head, before the rotary turn (as Qwen3)
            gains = torch.cat([self.q_norm.weight.expand(H, D), self.k_norm.weight.expand(H_kv, D)])
        if rotary is not None:
            cos, sin = (t[:, None] for t in rotary)  # angles (T, 1, D)
        if gains is not None or cos is not None:  # (B, T, H + H_kv, D)
            qk = fused_norm_turn(self.compiled, "QK-norm and rotary", qk, gains, cos, sin,
                                 self.q_norm.eps if self.qk_norm else 0.0)
        q, k = qk.split([H, H_kv], dim=2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, T, D), (B, H_kv, T, D)
        if cache is not None:
            # A prompt attends among itself (causal, or the band); after it one token at a
            # time attends to every held one, so no mask is needed.
            held = cache.append(layer, k, v)  # (B, H_kv, held, D)
            if T == 1:
                k, v = held
        if mask is not None and not torch.is_tensor(mask):  # a BlockMask
            if self.training and self.dropout:
                raise ValueError("FlexAttention has no attention dropout: model.dropout needs "
                                 "model.attention sdpa")
            y = flex.attend(q, k, v, mask, gqa=self.n_kv != self.n_head)  # (B, H, T, D)
        elif mask is None and cache is None and causal_cpu.runs(
                self.compiled, q, self.dropout if self.training else 0.0):
            y = causal_cpu.attend(q, k, v)  # (B, H, T, D): SDPA's numbers, sooner on a CPU
        else:
            masks = {"attn_mask": mask} if mask is not None else {"is_causal": T > 1}
            gqa = {"enable_gqa": True} if self.n_kv != self.n_head else {}
            y = F.scaled_dot_product_attention(q, k, v, **masks, **gqa,  # (B, H, T, D)
                                               dropout_p=self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).contiguous().view(B, T, self.n_head * self.head_dim)
        return self.resid_drop(self.proj(y))

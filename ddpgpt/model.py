"""A GPT-2-style decoder on one device. It knows nothing of processes: parallelism is applied from
the outside (`sync/ddp.py`'s wrap_model).

Token + learned position embeddings, pre-LayerNorm blocks of causal self-attention (through
`F.scaled_dot_product_attention`, which picks flash/memory-efficient kernels where it can) and a
GELU MLP, a final LayerNorm, and an output head tied to the token embedding. Initialization is
GPT-2's (normal 0.02, residual projections scaled by 1/sqrt(2·n_layer)), drawn from a private
generator seeded by the caller: the same seed gives bit-identical weights on every rank and device.

Generation keeps each layer's keys and values (`KVCache`), so a new token costs one token's
forward whatever the length. The context is at most block_size tokens; when a sequence outgrows
it, the window restarts from its last block_size // 2 tokens (`window_start`), re-encoded once,
and fills up again: with learned absolute positions a window that slid by one token would move
every cached key to a new position and leave nothing to reuse. The no-cache path follows the
same rule, so both give the same tokens.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from ddpgpt.config.schema import ModelConfig


class KVCache:
    """The keys and values of the tokens a sequence has seen, for every layer: (B, H, T_max, D)
    each, filled up to `length`. Allocated on the first write, in the dtype the keys come in
    (autocast: bf16)."""

    def __init__(self, n_layer: int, max_len: int):
        self.max_len, self.length = max_len, 0
        self.k: list[torch.Tensor | None] = [None] * n_layer
        self.v: list[torch.Tensor | None] = [None] * n_layer

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Writes this step's keys and values (B, H, T, D) after the cached ones; returns all of
        them so far, (B, H, length + T, D). `length` moves on once the last layer has written."""
        start, end = self.length, self.length + k.size(2)
        if end > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} tokens; {end} would overflow it")
        if self.k[layer] is None:
            shape = (k.size(0), k.size(1), self.max_len, k.size(3))
            self.k[layer] = k.new_empty(shape)
            self.v[layer] = v.new_empty(shape)
        self.k[layer][:, :, start:end] = k
        self.v[layer][:, :, start:end] = v
        if layer == len(self.k) - 1:
            self.length = end
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]


def window_start(start: int, length: int, block_size: int) -> int:
    """Where the context of the next token begins, given where it began for the previous one:
    unchanged while the window has room, else the last block_size // 2 tokens (at least one)."""
    if length - start <= block_size:
        return start
    return length - max(1, block_size // 2)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_head, self.n_embd, self.dropout = cfg.n_head, cfg.n_embd, cfg.dropout
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.proj.residual = True  # scaled init, see GPT.init_weights
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None,
                layer: int = 0) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
                   for t in (q, k, v))  # (B, H, T, D)
        causal = True
        if cache is not None:
            # A prefill (empty cache) is the plain causal case; after it one token at a time
            # attends to every cached one, so no mask is needed.
            if cache.length and T > 1:
                raise ValueError("a KV cache takes a prompt when empty, then one token at a time")
            causal = cache.length == 0
            k, v = cache.append(layer, k, v)  # (B, H, length + T, D)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=causal and T > 1,  # (B, H, T, D)
                                           dropout_p=self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.proj.residual = True
        self.drop = nn.Dropout(cfg.dropout)
        self.approximate = "tanh" if cfg.gelu == "tanh" else "none"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x), approximate=self.approximate)))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None,
                layer: int = 0) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), cache, layer)
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig, seed: int = 0):
        super().__init__()
        if cfg.vocab_size < 1:
            raise ValueError("GPT needs a resolved vocab_size (the dataset's, see "
                             "preflight.resolve)")
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.init_weights(seed)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """GPT-2 init from a private CPU generator: independent of the global RNG and the device."""
        gen = torch.Generator().manual_seed(seed)
        residual_std = 0.02 / math.sqrt(2 * self.cfg.n_layer)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                std = residual_std if getattr(module, "residual", False) else 0.02
                module.weight.copy_(torch.randn(module.weight.shape, generator=gen) * std)
                if getattr(module, "bias", None) is not None:
                    module.bias.zero_()
            elif isinstance(module, nn.LayerNorm):
                module.weight.fill_(1.0)
                if module.bias is not None:
                    module.bias.zero_()

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None,
                reduction: str = "mean",
                cache: KVCache | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """idx, targets: (B, T) int64. Returns logits (B, T, V) and, with targets, the cross-entropy
        (`reduction` mean or sum; targets of -1 are ignored). With a `cache`, idx continues the
        tokens it holds (positions from cache.length on), and their keys and values join it."""
        B, T = idx.shape
        past = cache.length if cache is not None else 0
        if past + T > self.cfg.block_size:
            raise ValueError(f"sequence of {past + T} tokens exceeds block_size "
                             f"{self.cfg.block_size}")
        pos = torch.arange(past, past + T, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, C)
        for i, block in enumerate(self.blocks):
            x = block(x, cache, i)
        logits = F.linear(self.ln_f(x), self.wte.weight)  # (B, T, V): head tied to the embedding
        if self.cfg.vocab_limit:
            # Padding rows never win: untrained rows at 0 would beat GPT-2's logits, which run
            # far below zero. -inf also keeps them out of the loss and its gradient.
            logits[..., self.cfg.vocab_limit:] = float("-inf")
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1),
                               ignore_index=-1, reduction=reduction)
        return logits, loss

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameters; by default without the position embedding, which does no matmul work (the
        token embedding stays: as the tied output head it does)."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.wpe.weight.numel() if non_embedding else n

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (forward + backward) at sequence length T:
        6·N for the weight matmuls (2 forward, 4 backward per multiply-add of N parameters), plus
        12·L·T·C for attention (QKᵀ and AV: 2·T·C each forward per layer, tripled for backward).
        The attention term counts the full T×T score matrix, as PaLM's MFU does, though causal
        kernels skip half of it."""
        L, C = self.cfg.n_layer, self.cfg.n_embd
        return 6 * self.num_params() + 12 * L * seq_len * C

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: int | None = None, generator: torch.Generator | None = None,
                 vocab_size: int | None = None, use_cache: bool = True) -> torch.Tensor:
        """Appends `max_new_tokens` sampled tokens to each row of idx (B, T): B prompts of one
        length, sampled together.

        The context is at most block_size tokens; past that it restarts from its last
        block_size // 2 (`window_start`). With `use_cache` (the default) keys and values are kept
        between tokens: the prompt is encoded once, then each token costs one token's forward,
        and each restart of the window one forward of the kept tokens, so the cost per token
        stays flat whatever the length. Without it every token re-encodes its whole context:
        the same tokens (fp32; both draw from `generator` once per token), at a cost that grows
        with the context.

        `temperature` 0: greedy decoding (the most likely token each time, as top_k=1).
        `vocab_size`: the tokenizer's own vocabulary. The model's may be padded up to a multiple
        of 64 (GPT-2's 50,257 ids -> 50,304 rows); the padding ids mean nothing to the
        tokenizer, so they are never sampled, however little the model has learned to avoid
        them."""
        block = self.cfg.block_size
        start, cache = max(0, idx.size(1) - block), None
        for _ in range(max_new_tokens):
            moved = window_start(start, idx.size(1), block)
            if not use_cache:
                logits = self(idx[:, moved:])[0]  # (B, T, V)
            elif cache is None or moved != start:  # the prompt, or a restarted window
                cache = KVCache(self.cfg.n_layer, block)
                logits = self(idx[:, moved:], cache=cache)[0]
            else:
                logits = self(idx[:, -1:], cache=cache)[0]  # (B, 1, V)
            start = moved
            logits = logits[:, -1, :].float()  # (B, V)
            if vocab_size is not None and vocab_size < logits.size(-1):
                logits[:, vocab_size:] = float("-inf")
            if temperature == 0:  # greedy: the most likely token, no draw
                nxt = logits.argmax(dim=-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k:
                    kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                probs = F.softmax(logits, dim=-1)
                nxt = torch.multinomial(probs, 1, generator=generator)  # (B, 1)
            idx = torch.cat([idx, nxt], dim=1)
        return idx

"""Sampling from the model, with the keys and values kept between tokens (`KVCache`), so that a
new token costs one token's forward whatever the length.

The context is at most block_size tokens. How it moves on when a sequence outgrows it depends on
the positions:
- rotary: the window slides by one token; the cache overwrites its oldest entry, every kept key
  stays as it was (its turn depends on its own position only, and attention on the difference of
  positions), and each token still costs one token's forward. Each layer then attends to the
  last block_size tokens, as a sliding-window model (Mistral's) does: a token's keys in the upper
  layers carry what it saw of tokens already out of the window, so the exact no-cache oracle is
  a forward with that band mask over the n_layer · (block_size - 1) + 1 tokens the last one
  depends on (`GPT.forward`'s window), not a fresh forward over the last block_size;
- learned: the window restarts from its last block_size // 2 tokens (`window_start`), re-encoded
  once, and fills up again: a window that slid by one token would move every cached key to a new
  position and leave nothing to reuse.
The no-cache path follows the same windows, so both give the same tokens.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F

from ddpgpt.model.attention import KVCache


def window_start(start: int, length: int, block_size: int) -> int:
    """Learned positions: where the context of the next token begins, given where it began for
    the previous one: unchanged while the window has room, else the last block_size // 2 tokens
    (at least one)."""
    if length - start <= block_size:
        return start
    return length - max(1, block_size // 2)


@torch.no_grad()
def generate(model, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
             top_k: int | None = None, generator: torch.Generator | None = None,
             vocab_size: int | None = None, use_cache: bool = True) -> torch.Tensor:
    """Appends `max_new_tokens` sampled tokens to each row of idx (B, T): B prompts of one
    length, sampled together (`tokens`, drawn to the end)."""
    drawn = list(tokens(model, idx, max_new_tokens, temperature, top_k, generator, vocab_size,
                        use_cache))
    return torch.cat([idx, *drawn], dim=1)


@torch.no_grad()
def tokens(model, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
           top_k: int | None = None, generator: torch.Generator | None = None,
           vocab_size: int | None = None, use_cache: bool = True) -> Iterator[torch.Tensor]:
    """The tokens drawn after each row of idx (B, T), one (B, 1) at a time, as they are drawn:
    a caller that stops reading (a chat's reply at its end-of-turn token) draws no more.

    With `use_cache` (the default) the prompt is encoded once, then each token costs one token's
    forward (and, with learned positions, each restart of the window one forward of the kept
    tokens). Without it every token re-encodes its whole context: the same tokens (fp32; both draw
    from `generator` once per token), at a cost that grows with the context.

    `temperature` 0: greedy decoding (the most likely token each time, as top_k=1).
    `vocab_size`: the tokenizer's own vocabulary. The model's may be padded up to a multiple
    of 64 (GPT-2's 50,257 ids -> 50,304 rows); the padding ids mean nothing to the
    tokenizer, so they are never sampled, however little the model has learned to avoid
    them."""
    cfg = model.cfg
    block, slide = cfg.block_size, cfg.rope
    # Sliding: the last token's logits depend on the tokens n_layer windows back (each layer
    # reaches block_size - 1 further), which is what the no-cache path re-encodes.
    reach = cfg.n_layer * (block - 1) + 1
    start, cache = max(0, idx.size(1) - block), None
    room = min(block, idx.size(1) + max_new_tokens)  # the most tokens a window will hold
    for _ in range(max_new_tokens):
        moved = start if slide else window_start(start, idx.size(1), block)
        if slide and not use_cache:
            logits = model(idx[:, -reach:], window=block)[0]  # (B, T, V)
        elif not use_cache:
            logits = model(idx[:, moved:])[0]
        elif cache is None or moved != start:  # the prompt, or a restarted window
            cache = KVCache(cfg.n_layer, room, slide=slide)
            prompt = idx[:, -reach:] if slide else idx[:, moved:]
            logits = model(prompt, cache=cache, window=block if slide else 0)[0]
        else:
            logits = model(idx[:, -1:], cache=cache)[0]  # (B, 1, V)
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
        yield nxt

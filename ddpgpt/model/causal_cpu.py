"""Causal attention in a training step on a CPU as its formula, block of queries by block,
compiled (model.kernels compiled): what the step runs there instead of SDPA's CPU kernel.

    if causal_cpu.runs(on, q, dropout):
        y = causal_cpu.attend(q, k, v)   # q (B, H, T, D), k and v (B, H_kv, T, D)

Each block of BLOCK queries takes the keys up to its own last one: the scores a batched product,
the causal mask an index comparison, the softmax, the product with the values. torch.compile
fuses the scale, the mask and the softmax into one loop each way and leaves the products to
torch's batched matmul, so only the blocks on and under the diagonal are computed (at T=256,
10 of the 16 blocks of 64 × 64). SDPA's CPU kernel skips masked keys too, but does its
products block by block inside one kernel at about half the matmul's rate: at the speedrun's
shape a layer's forward and backward takes 0.85-0.92 of SDPA's time (~47 against ~53 ms)
(docs/performance.md, "Causal attention by blocks"). The price is memory: the softmax of each
block row is kept for the backward (~0.6 · B·H·T² floats a layer: 10 MB at the speedrun's
shape), where SDPA keeps one logsumexp a row, and a compile that grows with the blocks. It
runs for rows of FROM to UP_TO tokens: below, the blocks skipped are too few to pay (level at
128 and 160); at T = 1,024 the gain was small or gone (0.88 to 0.98 of SDPA's time).

The numbers are SDPA's to rounding, forward and backward (tests/unit/test_causal_cpu.py).
Where it does not run (CUDA, evaluation, a mask, dropout, bf16, longer rows, a compiled model)
attention is SDPA's; where the compiler cannot build its kernel, model/fused.py says so once and
every piece runs eager from then on, this one as SDPA.
"""

from __future__ import annotations

import torch

from ddpgpt.model import fused

BLOCK = 64   # queries a block: at T=256 and 512, 64 beat 32 and 128 (docs/performance.md)
FROM = 192   # the shortest rows it runs for: at 128 and 160 the triangle saves too little
UP_TO = 512  # the longest (0.71-0.78 of SDPA's time at 512, 0.88-0.98 at 1,024)


def runs(on: bool, q: torch.Tensor, dropout: float) -> bool:
    """Whether causal attention over q (B, H, T, D) runs by blocks: model.kernels compiled
    (`on`) where model/fused.py's kernels run (a CPU, a training step), fp32, no attention
    dropout, rows of FROM to UP_TO tokens."""
    return (fused.active(on, q) and q.dtype == torch.float32 and not dropout
            and FROM <= q.size(2) <= UP_TO)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention, (B, H, T, D), through the compiled kernel of `by_blocks`."""
    return fused.call(True, "causal attention", by_blocks, q, k, v)


def by_blocks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block: int = BLOCK
              ) -> torch.Tensor:
    """softmax(q kᵀ / √D, causal) v, computed for `block` queries at a time against the keys up
    to their last: q (B, H, T, D), k and v (B, H_kv, T, D), H_kv dividing H (query head h reads
    key head h // (H / H_kv), as SDPA's enable_gqa). Returns (B, H, T, D)."""
    B, H, T, D = q.shape
    H_kv = k.size(1)
    # Contiguous once: the heads come as views of the projection (B, T, H, D). Alone the
    # layer's kernel was level either way; in the step this is 1-2% cheaper (docs/performance.md).
    q = q.contiguous().view(B, H_kv, H // H_kv, T, D)
    k, v = k.contiguous()[:, :, None], v.contiguous()[:, :, None]  # (B, H_kv, 1, T, D)
    out = []
    for start in range(0, T, block):
        end = min(start + block, T)
        scores = q[..., start:end, :] @ k[..., :end, :].transpose(-1, -2) * D ** -0.5
        # The mask as positions compared in the loop: as a bool tensor, inductor's softmax
        # loads and blends it, 2.4x slower.
        i = torch.arange(start, end, device=q.device)[:, None]  # the queries' positions
        j = torch.arange(end, device=q.device)                  # the keys'
        weights = torch.where(j <= i, scores, float("-inf")).softmax(-1)
        out.append(weights @ v[..., :end, :])  # (B, H_kv, H / H_kv, end - start, D)
    return torch.cat(out, -2).view(B, H, T, D)

"""FlexAttention's backward where torch has none (a CPU, torch 2.13): an autograd Function whose
forward is torch's flex_attention under the block mask (compiled where the device allows) and
whose backward is block-sparse attention backward written here, visiting only the blocks the
BlockMask lists, so that model.attention flex trains on a CPU.

    y = attention(q, k, v, mask, gqa, forward)   # forward(q, k, v, mask, gqa) -> (B, H, T, D)

The backward, for each row of query blocks m (the FlashAttention-2 backward, one query block row
at a time; every block of the row at once):
    kv blocks: mask.kv_indices[..., m, :kv_num_blocks] (partial: mask_mod applies within) and
               mask.full_kv_indices[..., m, :full_kv_num_blocks] (full: no mask)
    S = Q_m K^T · scale, masked;  P = exp(S - logsumexp(S))       (B, H, QB, W·KB)
    dV += P^T dO_m;  dP = dO_m V^T;  dS = P (dP - rowsum(dO_m O_m))
    dQ_m = dS K · scale;  dK += dS^T Q_m · scale
The row's logsumexp is recomputed from the same blocks rather than saved by the forward: torch
2.13's compiled CPU kernel refuses return_lse ("only supports inference"), and its uncompiled one
materializes every score, which is what the block mask is there to avoid. Grouped-query heads:
keys and values are expanded to the query heads and their gradients summed back over each group.
Costs: FlashAttention-2's five matmuls per visited block, a softmax over each block row where it
reads a saved logsumexp, and (B, H, QB, W·KB) floats live at a time, W the widest block row's
count of blocks (docs/performance.md measures it against SDPA's fused backward).

`mask.mask_mod` is evaluated on index tensors that broadcast (b: (Bm, 1, 1, 1), h: (1, Hm, 1, 1),
q_idx: (QB, 1), kv_idx: (Bm, Hm, 1, N)), not through vmap: written with elementwise
operations and indexing, as flex.block_mask's is, it takes them as they are.
"""

from __future__ import annotations

import torch


class _BlockSparseAttention(torch.autograd.Function):
    """flex attention of q (B, H, T, D) over k, v (B, H_kv, T, D) under a BlockMask."""

    @staticmethod
    def forward(ctx, q, k, v, mask, gqa, forward):
        # Detached: torch refuses inputs that require a gradient where it has no backward.
        out = forward(q.detach(), k.detach(), v.detach(), mask, gqa)  # (B, H, T, D)
        ctx.save_for_backward(q, k, v, out)
        ctx.mask = mask
        return out

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, out = ctx.saved_tensors
        dq, dk, dv = attention_backward(q, k, v, out, d_out, ctx.mask)
        return dq, dk, dv, None, None, None


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, gqa: bool,
              forward) -> torch.Tensor:
    """`forward`(q, k, v, mask, gqa) (torch's flex_attention under the BlockMask `mask`, with
    its default scale 1/sqrt(D)), differentiable through `attention_backward`."""
    return _BlockSparseAttention.apply(q, k, v, mask, gqa, forward)


@torch.no_grad()
def attention_backward(q, k, v, out, d_out, mask):
    """dq, dk, dv of softmax(q k^T / sqrt(D) under `mask`) v, given its output `out` and the
    output's gradient `d_out` (q, out, d_out: (B, H, T, D); k, v: (B, H_kv, T, D)). Computed in
    float32 (float64 stays float64), returned in the inputs' dtypes."""
    dtype = torch.promote_types(q.dtype, torch.float32)
    B, H, T, D = q.shape
    H_kv, S = k.size(1), k.size(2)
    group = H // H_kv
    scale = D ** -0.5
    QB, KB = mask.BLOCK_SIZE
    n_q, n_kv = -(-T // QB), -(-S // KB)
    q_, out_, do_ = (_pad(t.to(dtype), n_q * QB) for t in (q, out, d_out))  # (B, H, n_q·QB, D)
    k_, v_ = (_pad(t.to(dtype).repeat_interleave(group, dim=1) if group > 1 else t.to(dtype),
                   n_kv * KB).reshape(B, H, n_kv, KB, D) for t in (k, v))  # (B, H, n_kv, KB, D)
    delta = (do_ * out_).sum(-1, keepdim=True)  # (B, H, n_q·QB, 1): rowsum(dO · O)
    q_ = q_ * scale  # scaled once (T·D values, not T·N): S = (Q·scale) K^T, dK = dS^T (Q·scale)
    dq = torch.zeros_like(q_)
    dk, dv = torch.zeros_like(k_), torch.zeros_like(v_)
    b = torch.arange(B, device=q.device)[:, None, None]  # (B, 1, 1)
    h = torch.arange(H, device=q.device)[None, :, None]  # (1, H, 1)
    for m in range(n_q):
        blocks, allowed = _block_row(mask, m, T, S)  # (Bm, Hm, W), (Bm, Hm, QB, W·KB)
        if blocks.size(-1) == 0:
            continue  # no key may be attended from this row of blocks
        blocks = blocks.expand(B, H, -1)  # (B, H, W)
        rows = slice(m * QB, (m + 1) * QB)
        qm, dom = q_[:, :, rows], do_[:, :, rows]  # (B, H, QB, D)
        km, vm = (t[b, h, blocks].flatten(2, 3) for t in (k_, v_))  # (B, H, W·KB, D)
        s = (qm @ km.mT).masked_fill_(~allowed, float("-inf"))  # (B, H, QB, W·KB)
        p = torch.softmax(s, -1)  # (B, H, QB, W·KB): exp(S - logsumexp(S))
        if not allowed.any(-1).all():
            p.nan_to_num_(0.0)  # a row that attends nothing: no output, no gradient
        ds = (dom @ vm.mT).sub_(delta[:, :, rows]).mul_(p)  # (B, H, QB, W·KB)
        dq[:, :, rows] = ds @ km * scale
        # The blocks of one row are distinct (padding slots add zeros), so the sums are each
        # key block's, in the order of the rows: deterministic.
        dk.index_put_((b, h, blocks), (ds.mT @ qm).unflatten(2, (-1, KB)), accumulate=True)
        dv.index_put_((b, h, blocks), (p.mT @ dom).unflatten(2, (-1, KB)), accumulate=True)
    dk, dv = (t.flatten(2, 3)[:, :, :S].unflatten(1, (H_kv, group)).sum(2)  # (B, H_kv, S, D)
              for t in (dk, dv))
    return dq[:, :, :T].to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _block_row(mask, m: int, T: int, S: int):
    """The key blocks of query block row m, partial ones then full ones, (Bm, Hm, W) (padding
    slots hold block 0), and where attention is allowed within them, (Bm, Hm, QB, W·KB): the
    mask's batch and heads (Bm, Hm: 1 where it is shared)."""
    QB, KB = mask.BLOCK_SIZE
    device = mask.kv_indices.device
    lists = [(mask.kv_num_blocks, mask.kv_indices, True)]
    if mask.full_kv_num_blocks is not None:
        lists.append((mask.full_kv_num_blocks, mask.full_kv_indices, False))
    i = (m * QB + torch.arange(QB, device=device)[:, None]).clamp(max=T - 1)  # (QB, 1)
    blocks, allowed = [], []
    for counts, indices, partial in lists:
        counts = counts[:, :, m, None].long()  # (Bm, Hm, 1)
        width = int(counts.max())
        slots = torch.arange(width, device=device)  # (W,)
        taken = slots < counts  # (Bm, Hm, W)
        idx = indices[:, :, m, :width].long().masked_fill(~taken, 0)  # (Bm, Hm, W)
        j = (idx[..., None] * KB + torch.arange(KB, device=device)).flatten(2)  # (Bm, Hm, W·KB)
        # Rows past T (padding: zero queries and output gradients, so they add nothing) attend
        # as row T - 1 does: a row that attends nothing is the mask's own.
        ok = (taken.repeat_interleave(KB, -1) & (j < S))[:, :, None]  # (Bm, Hm, 1, W·KB)
        if partial:  # mask_mod within the block, on positions clamped into the rows
            bm, hm = (torch.arange(n, device=device) for n in idx.shape[:2])
            ok = ok & mask.mask_mod(bm[:, None, None, None], hm[None, :, None, None], i,
                                    j.clamp(max=S - 1)[:, :, None])
        blocks.append(idx)
        allowed.append(ok.expand(-1, -1, QB, -1))  # (Bm, Hm, QB, W·KB)
    return torch.cat(blocks, -1), torch.cat(allowed, -1)


def _pad(t: torch.Tensor, length: int) -> torch.Tensor:
    """t (B, H, T, D) with zero rows up to `length` (t itself when it has them)."""
    if t.size(2) == length:
        return t
    return torch.nn.functional.pad(t, (0, 0, 0, length - t.size(2)))

"""FlexAttention's gradients where torch has no backward (model/flex_cpu.py, a CPU): the same as
SDPA's under the dense mask (≤ 1e-5 fp32, relative to the largest value) for one layer and for
both archs' models, with and without grouped-query heads and the sliding band, documents that
cross row starts, rows that end inside a block; and torch.autograd.gradcheck's finite differences
in float64, blocks of unequal sizes included."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
import torch.nn.functional as F

from ddpgpt.model import flex, flex_cpu
from ddpgpt.model.gpt import GPT
from tests.unit.test_flex import ARCHS, BOS, compare_layer, layer_pair, perturbed, rows

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def uncompiled():
    """torch's forward uncompiled (the same numbers; a compile is ~5 s a shape on a CPU)."""
    with flex.uncompiled("cpu"):
        yield


def test_a_cpu_trains_through_its_own_backward():
    assert not flex.native_backward("cpu"), "torch has a CPU backward now: compare it too"
    assert flex.native_backward("cuda") and flex.refusal("cpu", 0.0) == ""
    q, k, v = (torch.randn(1, 4, 16, 8, requires_grad=True) for _ in range(3))
    mask = flex.block_mask(rows(1, 16, 4), BOS)
    y = flex.attend(q, k, v, mask, gqa=False)
    assert y.grad_fn.name() == "_BlockSparseAttentionBackward"
    y.sum().backward()
    assert q.grad.abs().sum() > 0
    with torch.no_grad():  # no gradient asked for: torch's forward alone
        assert torch.equal(flex.attend(q, k, v, mask, gqa=False), y)


@pytest.mark.parametrize("window", [0, 70], ids=["documents", "documents+band"])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
def test_one_layer_s_gradients_are_the_dense_mask_s(heads, window):
    """300 tokens: 3 blocks of 128 a side, skipped, full and cut (documents of ~40, a band of
    70); the last block ends at token 300."""
    diffs = compare_layer(layer_pair(*heads), rows(3, 300, 40), window, grads=True)
    assert max(diffs) <= 1e-5, diffs


@pytest.mark.parametrize("arch, kv, window", [
    ("gpt2", 0, 0), ("gpt2", 2, 0), ("modern", 0, 0), ("modern", 2, 0),
    ("modern", 0, 70), ("modern", 2, 70)])  # a band (window) needs rotary positions
def test_the_model_s_gradients_are_sdpa_s(arch, kv, window):
    """Every parameter's gradient of the loss, rows of 300 with documents of ~40 crossing row
    starts (and the band of 70)."""
    cfg = dataclasses.replace(ARCHS[arch], n_head=4, n_kv_head=kv, block_size=300)
    idx = rows(2, 300, 40, seed=1)
    grads = {}
    for attention in ("sdpa", "flex"):
        model = perturbed(GPT(dataclasses.replace(cfg, attention=attention), seed=3))
        assert ("cpu" in model.flex_on) == (attention == "flex")
        _, loss = model(idx, idx.roll(-1, 1), window=window)
        loss.backward()
        grads[attention] = {n: p.grad for n, p in model.named_parameters()}
    want, got = grads["sdpa"], grads["flex"]
    diffs = {n: ((got[n] - want[n]).abs().max() / want[n].abs().max()).item() for n in want}
    assert max(diffs.values()) <= 1e-5, diffs
    assert all(want[n].abs().max() > 0 for n in want if ".attn." in n)  # gradients to compare


def _mask(B: int, T: int, window: int, block, every: int, seed: int = 0):
    """A BlockMask over rows (B, T) with documents of ~`every` (crossing row starts) and the
    band, blocks of `block` (q, kv), and the same rule as a dense (B, 1, T, T) bool mask."""
    from torch.nn.attention.flex_attention import create_block_mask

    segment = torch.cumsum(rows(B, T, every, seed) == BOS, dim=1)  # (B, T)

    def allowed(b, h, i, j):
        keep = (j <= i) & (segment[b, i] == segment[b, j])
        return keep & (i - j < window) if window else keep

    i = torch.arange(T)
    dense = allowed(torch.arange(B)[:, None, None, None], 0, i[:, None], i)  # (B, 1, T, T)
    return create_block_mask(allowed, B, None, T, T, device="cpu", BLOCK_SIZE=block), dense


def _eager_forward(q, k, v, mask, gqa):
    from torch.nn.attention.flex_attention import flex_attention

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "called without torch.compile"
        return flex_attention(q, k, v, block_mask=mask, enable_gqa=gqa)


@pytest.mark.parametrize("block, every, window", [((8, 8), 6, 10), ((4, 8), 6, 10),
                                                   ((8, 4), 6, 10), ((4, 4), 100, 0)],
                         ids=["8", "4x8", "8x4", "4-full-blocks"])
def test_gradcheck_in_float64(block, every, window):
    """Finite differences against the backward: a row of 20 (blocks cut at its end), 2 query
    heads over 1 key/value head, documents of ~6 and a band of 10, or one document (blocks
    below the diagonal are full: no mask_mod); each finite difference is one uncompiled
    FlexAttention forward, so the case is small."""
    mask, _ = _mask(1, 20, window, block, every)
    assert bool(mask.full_kv_num_blocks.any()) == (window == 0)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 20, 4, dtype=torch.float64, generator=gen, requires_grad=True)
    k, v = (torch.randn(1, 1, 20, 4, dtype=torch.float64, generator=gen, requires_grad=True)
            for _ in range(2))
    assert torch.autograd.gradcheck(
        lambda q, k, v: flex_cpu.attention(q, k, v, mask, True, _eager_forward), (q, k, v))


@pytest.mark.parametrize("block, every, window", [
    ((128, 128), 30, 50), ((32, 64), 30, 50), ((64, 32), 30, 50), ((32, 32), 150, 0)],
    ids=["128", "32x64", "64x32", "32-full-blocks"])
def test_the_backward_is_sdpa_s_under_the_dense_mask(block, every, window):
    """The Function alone at 200 tokens (blocks cut at the end), MQA, documents of ~30 and a
    band of 50, or documents of ~150 (full blocks), against SDPA's autograd with the dense mask
    the same rule gives: ≤ 1e-5 fp32."""
    mask, dense = _mask(3, 200, window, block, every, seed=2)
    assert bool(mask.full_kv_num_blocks.any()) == (window == 0)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(3, 4, 200, 16, generator=gen, requires_grad=True)
    k, v = (torch.randn(3, 1, 200, 16, generator=gen, requires_grad=True) for _ in range(2))
    d_out = torch.randn(3, 4, 200, 16, generator=gen)
    want = torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, attn_mask=dense,
                                                              enable_gqa=True), (q, k, v), d_out)
    y = flex_cpu.attention(q, k, v, mask, True, _eager_forward)
    got = torch.autograd.grad(y, (q, k, v), d_out)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5 * b.abs().max().item())


def test_the_backward_is_the_same_bits_every_time():
    """Deterministic (exact resume needs it): two backward passes, equal bit for bit."""
    mask, _ = _mask(2, 300, 0, (128, 128), 40)
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 4, 300, 16, generator=gen, requires_grad=True) for _ in range(3))
    got = [torch.autograd.grad(flex_cpu.attention(q, k, v, mask, False, _eager_forward).sum(),
                               (q, k, v)) for _ in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(*got))


@pytest.mark.slow
@pytest.mark.timeout(600)  # a hang guard: a minute of compiling at load 3, four at load 15
def test_a_compiled_model_trains_through_it(monkeypatch):
    """run.compile: the backward's call is a graph break (its block lists are read as data),
    torch's compiled kernel the forward; the gradients are still SDPA's (a minute to compile)."""
    cfg = dataclasses.replace(ARCHS["modern"], n_head=4, n_kv_head=2, block_size=160)
    idx = rows(2, 160, 30, seed=1)
    grads = {}
    monkeypatch.delitem(flex._uncompiled, "cpu")  # compiled, as a run compiles it
    for attention in ("sdpa", "flex"):
        model = perturbed(GPT(dataclasses.replace(cfg, attention=attention), seed=3))
        _, loss = torch.compile(model)(idx, idx.roll(-1, 1))
        loss.backward()
        grads[attention] = [p.grad for p in model.parameters()]
    assert "cpu" not in flex._uncompiled
    assert max(((a - b).abs().max() / b.abs().max()).item()
               for a, b in zip(grads["flex"], grads["sdpa"])) <= 1e-5

"""Causal attention by blocks (model/causal_cpu.py): SDPA's numbers forward and backward, as the
formula and as its compiled kernel, and where it runs instead of SDPA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ddpgpt.model import causal_cpu, fused

pytestmark = pytest.mark.usefixtures("one_thread")


def _heads(B, T, H, H_kv, D, dtype, seed=0):
    """q (B, H, T, D), k and v (B, H_kv, T, D) as the model makes them: views of one (B, T, ...)
    projection, transposed; leaves that take gradients."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(B, T, (H + 2 * H_kv) * D, generator=gen, dtype=dtype, requires_grad=True)
    q, k, v = qkv.split([H * D, H_kv * D, H_kv * D], dim=2)
    q, k, v = (t.view(B, T, -1, D).transpose(1, 2) for t in (q, k, v))
    return qkv, q, k, v


def _out_and_grad(attention, B, T, H, H_kv, D, dtype=torch.float64):
    qkv, q, k, v = _heads(B, T, H, H_kv, D, dtype)
    y = attention(q, k, v)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=dtype)
    y.backward(dy)
    return y.detach(), qkv.grad


def _sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                          enable_gqa=k.size(1) != q.size(1))


@pytest.mark.parametrize("T, block", [(48, 16), (40, 16), (5, 16), (16, 16)])
@pytest.mark.parametrize("H, H_kv", [(4, 4), (4, 2), (3, 1)])
def test_the_formula_is_sdpa_forward_and_backward(T, block, H, H_kv):
    """Blocks that divide the rows and blocks that do not (the last one short), rows shorter than
    a block, one block exactly; every query head its own key head, and grouped ones: the output
    and the gradient of the projection they came from, SDPA's to fp64 rounding."""
    ours = _out_and_grad(lambda q, k, v: causal_cpu.by_blocks(q, k, v, block), 2, T, H, H_kv, 8)
    theirs = _out_and_grad(_sdpa, 2, T, H, H_kv, 8)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


@pytest.mark.timeout(300)
def test_the_compiled_kernel_is_sdpa_to_fp32_rounding(fresh_kernels):
    """The kernel the step runs (three blocks of 64, the last one short; grouped heads): SDPA's
    output and gradients to fp32 rounding."""
    shape = (2, 150, 4, 2, 16)
    ours = _out_and_grad(causal_cpu.attend, *shape, dtype=torch.float32)
    assert set(fused._kernels) == {"causal attention"} and fused.failure == ""
    theirs = _out_and_grad(_sdpa, *shape, dtype=torch.float32)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_where_it_runs(fresh_kernels):
    """A training step's fp32 rows of FROM to UP_TO tokens on a CPU, with model.kernels compiled:
    not without the kernels, without gradients (evaluation, sampling), with attention dropout,
    in bf16, for shorter or longer rows, nor once a kernel has failed to compile."""
    def q(T, dtype=torch.float32):
        return torch.zeros(1, 2, T, 8, dtype=dtype)

    T = causal_cpu.FROM
    assert causal_cpu.runs(True, q(T), 0.0) and causal_cpu.runs(True, q(causal_cpu.UP_TO), 0.0)
    assert not causal_cpu.runs(False, q(T), 0.0)
    assert not causal_cpu.runs(True, q(T), 0.1)
    assert not causal_cpu.runs(True, q(T, torch.bfloat16), 0.0)
    assert not causal_cpu.runs(True, q(T - 1), 0.0)
    assert not causal_cpu.runs(True, q(causal_cpu.UP_TO + 1), 0.0)
    with torch.no_grad():
        assert not causal_cpu.runs(True, q(T), 0.0)
    fused.failure = "RuntimeError: no C compiler"
    assert not causal_cpu.runs(True, q(T), 0.0)

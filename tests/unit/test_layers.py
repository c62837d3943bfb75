"""The hand-written backward passes of model/layers.py (RMSNorm on a CPU, the rotary turn, and
norm_turn_grad, the gradient model/fused.py compiles) against autograd through the plain
formulas, in float64 and float32, and their dtypes."""

from __future__ import annotations

import math

import pytest
import torch

from ddpgpt.model.layers import norm_turn_grad, rms_norm, rotary, rotate

pytestmark = pytest.mark.usefixtures("one_thread")


def _plain_rms(x, gain, eps):
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * gain).to(x.dtype)


def _plain_turn(x, cos, sin):
    half = x.size(-1) // 2
    turned = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos + turned * sin).to(x.dtype)


def _grads(fn, *inputs, seed=3):
    """fn's output and the gradients of a random linear function of it w.r.t. each input."""
    inputs = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    out = fn(*inputs)
    (out * _weight(out, seed)).sum().backward()
    return out.detach(), [t.grad for t in inputs if t.requires_grad]


def _weight(out, seed=3):
    """The random linear function of `_grads`: its gradient w.r.t. `out`."""
    return torch.randn(out.shape, generator=torch.Generator().manual_seed(seed),
                       dtype=torch.float64).to(out.dtype)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-6)])
@pytest.mark.parametrize("gain_shape", [(16,), (3, 16)])  # one gain, or one per head
def test_rms_norm_and_its_gradients_are_the_formula(dtype, tol, gain_shape):
    gen = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(2, 5, 3, 16, generator=gen)).to(dtype)
    gain = (1 + 0.3 * torch.randn(gain_shape, generator=gen)).to(dtype)
    got, got_grads = _grads(lambda a, g: rms_norm(a, g, 1e-5), x, gain)
    want, want_grads = _grads(lambda a, g: _plain_rms(a, g, 1e-5), x, gain)
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=tol, atol=tol * w.abs().max().item())


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-6)])
@pytest.mark.parametrize("layout", ["BHTD", "BTHD"])
def test_the_rotary_turn_and_its_gradient_are_the_formula(dtype, tol, layout):
    gen = torch.Generator().manual_seed(1)
    cos, sin = rotary(torch.arange(7), 8, 100.0)  # (T, D) each
    if layout == "BTHD":
        x, cos, sin = torch.randn(2, 7, 3, 8, generator=gen), cos[:, None], sin[:, None]
    else:
        x = torch.randn(2, 3, 7, 8, generator=gen)
    x, cos, sin = x.to(dtype), cos.to(dtype), sin.to(dtype)
    got, (got_grad,) = _grads(lambda a: rotate(a, cos, sin), x)
    want, (want_grad,) = _grads(lambda a: _plain_turn(a, cos, sin), x)
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    torch.testing.assert_close(got_grad, want_grad, rtol=tol, atol=tol)
    # a turn keeps each pair's length: the angles are applied, not scaled
    half = x.size(-1) // 2
    length = got[..., :half] ** 2 + got[..., half:] ** 2
    torch.testing.assert_close(length, x[..., :half] ** 2 + x[..., half:] ** 2)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-6)])
@pytest.mark.parametrize("turn,rows", [(True, 6 * 7), (False, 6 * 7), (True, 64 * 7), (False, 5)])
def test_the_written_norm_gradient_is_autograd_s(dtype, tol, turn, rows):
    """QK-norm with the turn (one gain per head) and RMSNorm alone (one gain): dx and the gain's
    partial sums, added up, against autograd through the formula; rows that 64 divides, and
    rows it does not (fewer partial sums)."""
    gen = torch.Generator().manual_seed(4)
    T, heads, D = (7, 3, 8) if turn else (rows, 1, 16)
    x = (2 * torch.randn(rows // T, T, heads, D, generator=gen)).to(dtype)
    gain = (1 + 0.3 * torch.randn(heads, D, generator=gen)).to(dtype)
    cos = sin = None
    if turn:
        cos, sin = (t[:, None].to(dtype) for t in rotary(torch.arange(T), D, 100.0))
    else:
        x, gain = x[:, :, 0], gain[0]  # (B, T, D), (D,)

    def plain(a, g):
        y = _plain_rms(a, g, 1e-5)
        return _plain_turn(y, cos, sin) if turn else y

    want, (want_dx, want_dg) = _grads(plain, x, gain)
    dx, partial, *rest = norm_turn_grad(x, gain, cos, sin, 1e-5, _weight(want))
    assert rest == [None, None, None] and dx.dtype == dtype
    assert partial.shape == (math.gcd(rows * heads * D // gain.numel(), 64), *gain.shape)
    torch.testing.assert_close(dx, want_dx, rtol=tol, atol=tol * want_dx.abs().max().item())
    torch.testing.assert_close(partial.sum(0), want_dg, rtol=tol,
                               atol=tol * want_dg.abs().max().item())


def test_bf16_inputs_come_back_in_bf16_computed_in_fp32():
    x = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(2)).bfloat16()
    gain = torch.ones(16)
    got = rms_norm(x, gain, 1e-5)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, _plain_rms(x, gain, 1e-5), rtol=0, atol=0)
    cos, sin = rotary(torch.arange(4), 16, 10000.0)
    turned = rotate(x, cos, sin)
    assert turned.dtype == torch.bfloat16
    torch.testing.assert_close(turned, _plain_turn(x, cos, sin), rtol=0, atol=1e-2)

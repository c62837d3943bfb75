"""model.kernels compiled (model/fused.py): the modern pieces through torch.compile's kernels on a
CPU give eager's loss and gradients; where a kernel runs and where eager's ops do; and where the
compiler fails, one line and eager's numbers."""

from __future__ import annotations

import pytest
import torch

from ddpgpt.config.checks import ConfigError
from ddpgpt.config.model import ModelConfig
from ddpgpt.model import causal_cpu, fused
from ddpgpt.model.gpt import GPT
from ddpgpt.model.layers import swiglu

pytestmark = pytest.mark.usefixtures("one_thread")

SHAPE = dict(n_layer=2, n_head=4, n_embd=64, block_size=32, vocab_size=97, arch="modern")
PIECES = {"RMSNorm", "QK-norm and rotary", "SwiGLU", "cross-entropy", "causal attention",
          "RMSNorm backward", "QK-norm and rotary backward"}  # the norms' written-out gradients


@pytest.fixture
def fresh(fresh_kernels, monkeypatch):
    """fused's module state as at import (`fresh_kernels`), and attention by blocks for rows of
    any length (these are shorter than causal_cpu.FROM)."""
    monkeypatch.setattr(causal_cpu, "FROM", 2)


def _loss_and_grads(cfg: ModelConfig, idx, targets):
    model = GPT(cfg, seed=1)
    _, loss = model(idx, targets)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def _eager_and_compiled():
    """_loss_and_grads of the model eager and with model.kernels compiled, on one short batch."""
    idx = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(0))
    return (_loss_and_grads(ModelConfig(**SHAPE), idx, idx),
            _loss_and_grads(ModelConfig(**SHAPE, kernels="compiled"), idx, idx))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("pieces", [{}, {"rope": False, "bias": True}, {"mlp": "relu2"}])
def test_compiled_kernels_give_eager_loss_and_gradients(fresh, pieces):
    """Every piece compiled (QK-norm with the turn; QK-norm alone, with biases; ReLU² for SwiGLU),
    against eager's ops and written-out backwards: the loss and every parameter's gradient to fp32
    rounding."""
    gen = torch.Generator().manual_seed(0)
    idx, targets = (torch.randint(0, 97, (4, 32), generator=gen) for _ in range(2))
    targets[0, :5] = -1  # ignored, as padding is
    eager = _loss_and_grads(ModelConfig(**SHAPE, **pieces), idx, targets)
    compiled = _loss_and_grads(ModelConfig(**SHAPE, **pieces, kernels="compiled"), idx, targets)
    assert fused.failure == ""
    mlp = {"SwiGLU"} if "mlp" not in pieces else {"ReLU²"}
    assert set(fused._kernels) == PIECES - {"SwiGLU"} | mlp
    torch.testing.assert_close(compiled[0], eager[0], rtol=0, atol=2e-6)
    for name, grad in eager[1].items():
        torch.testing.assert_close(compiled[1][name], grad, rtol=1e-4, atol=1e-7, msg=name)


def test_where_kernels_run():
    """Only a training forward on a CPU with model.kernels compiled: not eager's setting, not
    under no_grad (evaluation, sampling), not on another device."""
    x = torch.zeros(2)
    assert fused.active(True, x)
    assert not fused.active(False, x)
    with torch.no_grad():
        assert not fused.active(True, x)
    assert not fused.active(True, torch.zeros(2, device="meta"))


def test_evaluation_compiles_nothing(fresh):
    model = GPT(ModelConfig(**SHAPE, kernels="compiled"), seed=1)
    idx = torch.zeros(1, 8, dtype=torch.long)
    with torch.no_grad():
        _, loss = model(idx, idx)
    assert fused._kernels == {} and torch.isfinite(loss)


def test_compiler_failure_says_so_once_and_runs_eager(fresh, monkeypatch, capsys):
    """torch.compile's kernel failing to build (as with no C compiler): one line, eager's numbers,
    and no second try."""
    builds = []

    def failing_compile(fn, **kwargs):
        def kernel(*args):
            builds.append(fn)
            raise RuntimeError("InvalidCxxCompiler: No working C compiler detected.\nmore")
        return kernel

    monkeypatch.setattr(torch, "compile", failing_compile)
    eager, compiled = _eager_and_compiled()
    assert torch.equal(compiled[0], eager[0])
    assert all(torch.equal(compiled[1][n], g) for n, g in eager[1].items())
    assert len(builds) == 1  # the first piece's failure; every other piece then runs eager
    assert capsys.readouterr().err.splitlines() == [
        "ddpgpt: model.kernels compiled: torch.compile cannot build the RMSNorm kernel here "
        "(RuntimeError: InvalidCxxCompiler: No working C compiler detected.); the pieces run as "
        "eager ops from now on: the same numbers, slower"]


def test_a_gradient_kernel_that_fails_says_so_once_and_runs_its_formula(fresh, monkeypatch,
                                                                         capsys):
    """The norms' written-out gradient failing to compile (the forward kernels built): one line,
    the formula's gradients eagerly, and every piece eager from then on."""
    real = torch.compile

    def compile_but_the_gradient(fn, **kwargs):
        if fn.__name__ != "norm_turn_grad":
            return real(fn, **kwargs)

        def kernel(*args):
            raise RuntimeError("CppCompileError: C++ compile error\nmore")
        return kernel

    monkeypatch.setattr(torch, "compile", compile_but_the_gradient)
    eager, compiled = _eager_and_compiled()
    for name, grad in eager[1].items():
        torch.testing.assert_close(compiled[1][name], grad, rtol=1e-4, atol=1e-7, msg=name)
    assert capsys.readouterr().err.splitlines() == [
        "ddpgpt: model.kernels compiled: torch.compile cannot build the RMSNorm backward kernel "
        "here (RuntimeError: CppCompileError: C++ compile error); the pieces run as eager ops "
        "from now on: the same numbers, slower"]
    assert not fused.active(True, torch.zeros(2))


def test_inputs_at_fault_raise_as_eager(fresh):
    """A shape error is the inputs', not the compiler's: eager's error, and the kernels stay on."""
    gate, up = torch.zeros(2, 3, 5, requires_grad=True), torch.zeros(2, 3, 4)
    with pytest.raises(RuntimeError, match="must match the size"):
        fused.call(True, "SwiGLU", swiglu, gate, up)
    assert fused.failure == ""


def test_bad_setting():
    with pytest.raises(ConfigError, match=r"model.kernels = 'fast'; choose one of eager, "
                                          r"compiled$"):
        ModelConfig(kernels="fast")

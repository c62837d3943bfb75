"""The modern pieces' elementwise work as compiled kernels on a CPU (model.kernels compiled).

Eager, each piece is a chain of passes over its activations, forward and backward: RMSNorm,
QK-norm and the rotary turn, SwiGLU's silu(gate) · up or ReLU², the cross-entropy's log-softmax (the
written-out backwards of model/layers.py shorten those chains, not to one pass). torch.compile
(inductor, with the system's C compiler) fuses each piece's forward into one C++ loop and its
backward into another; the matrix products and attention stay torch's kernels, outside them
(docs/performance.md, "The step against nanoGPT's, op by op"), but for causal attention by
blocks (model/causal_cpu.py: its formula through `call`, the products torch's batched matmul).

    y = fused.call(on, "RMSNorm", norm_turn, x, gain, None, None, eps)

The formulas are the pieces' own (layers.py's `norm_turn`, `swiglu` and `relu2`, gpt.py's
`cross_entropy`): what a compiled model (run.compile) traces into its graph too, and what runs
eagerly where the compiler fails. `active` says where a kernel runs: model.kernels compiled, a
CPU tensor, gradients on (a training forward: evaluation and sampling take other shapes, each of
which would compile anew) and no compile around it. A kernel is compiled for each shape it
meets (a training run has one: seconds at its first step, then inductor's cache on disk). Where
torch.compile cannot build a kernel (no C compiler), one line says so and eager's ops run from
then on: the same numbers to rounding.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TypeVar

import torch
from torch.autograd.function import once_differentiable

T = TypeVar("T")
_kernels: dict[str, Callable] = {}  # name -> torch.compile of its formula
failure = ""                         # why torch.compile could not build a kernel here ("": none)


def active(on: bool, x: torch.Tensor) -> bool:
    """Whether a piece of a model with model.kernels `on` runs its compiled kernel on x."""
    return (on and not failure and x.device.type == "cpu" and torch.is_grad_enabled()
            and not torch.compiler.is_compiling())


def call(on: bool, name: str, formula: Callable, *args, grad: Callable | None = None):
    """formula(*args): through its compiled kernel where `active` (on args[0]), else as it is.
    The kernel's backward is autograd's through the formula, or with `grad` (its gradients
    written out: grad(*args, dy) gives one per arg, None where there is none) a compiled kernel
    of that; a gradient with one more dim than its arg is partial sums, added up here. Where
    the compiler fails, says so once and runs the formula from then on (which raises when the
    inputs are at fault, not the compiler)."""
    if not active(on, args[0]):
        return formula(*args)

    def compiled():
        if grad is None:
            return kernel(name, formula)(*args)
        return _Written.apply(name, formula, grad, *args)
    return _checked(name, compiled, lambda: formula(*args))


# A written-out gradient reads dy's and x's pieces several times each; at inductor's default
# (a value read more than 4 times is written out as a buffer first) QK-norm's with the turn
# takes an extra pass over memory: 3.5 against 2.5 ms a layer at the speedrun's shape.
GRAD_OPTIONS = {"realize_reads_threshold": 16}


def kernel(name: str, formula: Callable, options: dict | None = None) -> Callable:
    """The compiled kernel of `formula`, built at its first call and kept under `name`
    (`options`: inductor's, those this torch has)."""
    if name not in _kernels:
        import torch._inductor.config as inductor
        known = {k: v for k, v in (options or {}).items() if hasattr(inductor, k)}
        _kernels[name] = torch.compile(formula, dynamic=False, options=known or None)
    return _kernels[name]


def _checked(name: str, compiled: Callable[[], T], eager: Callable[[], T]) -> T:
    """`attempt`, and where the compiler failed, one line and eager's ops from then on."""
    global failure
    out, why = attempt(compiled, eager)
    if why:
        failure = why
        print(f"ddpgpt: model.kernels compiled: torch.compile cannot build the {name} kernel here "
              f"({why}); the pieces run as eager ops from now on: the same numbers, slower",
              file=sys.stderr)
    return out


class _Written(torch.autograd.Function):
    """A formula's kernel forward, and its written-out gradient's kernel backward (`call`)."""

    @staticmethod
    def forward(ctx, name: str, formula: Callable, grad: Callable, *args):
        ctx.name, ctx.grad = name, grad
        ctx.places = [i for i, a in enumerate(args) if torch.is_tensor(a)]
        ctx.args = [None if torch.is_tensor(a) else a for a in args]
        ctx.save_for_backward(*(args[i] for i in ctx.places))
        return kernel(name, formula)(*args)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy: torch.Tensor):
        args = list(ctx.args)
        for i, t in zip(ctx.places, ctx.saved_tensors):
            args[i] = t
        name = f"{ctx.name} backward"
        if failure:  # a kernel failed since this forward: eager's formula, no second line
            grads = ctx.grad(*args, dy)
        else:
            grads = _checked(name, lambda: kernel(name, ctx.grad, GRAD_OPTIONS)(*args, dy),
                             lambda: ctx.grad(*args, dy))
        grads = [g.sum(0) if g is not None and g.dim() > a.dim() else g
                 for g, a in zip(grads, args)]
        return (None, None, None, *grads)


def attempt(compiled: Callable[[], T], eager: Callable[[], T]) -> tuple[T, str]:
    """compiled()'s result and "", or where it raises, eager()'s and why compiled() failed (its
    exception's type and first line). eager() raises in turn where the inputs are at fault, not
    the compiler: then that error is the caller's, and nothing is blamed on the compiler."""
    try:
        return compiled(), ""
    except Exception as e:  # noqa: BLE001 -- the compiler's failure; the inputs' is re-raised
        caught = e
    out = eager()
    first = (str(caught).strip().splitlines() or [""])[0][:200]
    return out, f"{type(caught).__name__}: {first}"

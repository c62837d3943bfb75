"""The modern pieces' elementwise work as compiled kernels on a CPU (model.kernels compiled).

Eager, each piece is a chain of passes over its activations, forward and backward: RMSNorm,
QK-norm and the rotary turn, SwiGLU's silu(gate) · up or ReLU², the cross-entropy's log-softmax (the
written-out backwards of model/layers.py shorten those chains, not to one pass). torch.compile
(inductor, with the system's C compiler) fuses each piece's forward into one C++ loop and its
backward into another; the matrix products and attention stay torch's kernels, outside them
(docs/performance.md, "The step against nanoGPT's, op by op").

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

T = TypeVar("T")
_kernels: dict[str, Callable] = {}  # name -> torch.compile of its formula
failure = ""                         # why torch.compile could not build a kernel here ("": none)


def active(on: bool, x: torch.Tensor) -> bool:
    """Whether a piece of a model with model.kernels `on` runs its compiled kernel on x."""
    return (on and not failure and x.device.type == "cpu" and torch.is_grad_enabled()
            and not torch.compiler.is_compiling())


def call(on: bool, name: str, formula: Callable, *args):
    """formula(*args): through its compiled kernel where `active` (on args[0]), else as it is.
    Where the compiler fails, says so once and runs the formula from then on (which raises when
    the inputs are at fault, not the compiler)."""
    global failure
    if not active(on, args[0]):
        return formula(*args)
    if name not in _kernels:
        _kernels[name] = torch.compile(formula, dynamic=False)
    out, why = attempt(lambda: _kernels[name](*args), lambda: formula(*args))
    if why:
        failure = why
        print(f"ddpgpt: model.kernels compiled: torch.compile cannot build the {name} kernel here "
              f"({why}); the pieces run as eager ops from now on: the same numbers, slower",
              file=sys.stderr)
    return out


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

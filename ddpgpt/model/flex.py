"""FlexAttention for masked attention (model.attention flex): one block mask per batch, built from
the rows' document ids (causal × same document × the sliding band), shared by every layer, so
that the kernel skips the blocks the mask rules out where SDPA with a dense (B, 1, T, T) mask
computes every one of them.

    mask = block_mask(idx, bos_id, window=0)     # once per forward: (B, 1, T, T) in blocks
    y = attend(q, k, v, mask, gqa=True)           # in every layer

What torch's FlexAttention (torch.nn.attention.flex_attention, torch >= 2.5) does where
(docs/performance.md, "Attention that skips what it masks"):
- CUDA: forward and backward, compiled by torch.compile into Triton kernels (what torch
  documents; `ddpgpt check` measures it where a GPU is lent);
- CPU (torch 2.13, measured): the forward only, compiled into a C++ kernel (inductor, the
  system's C compiler). torch refuses its backward on a CPU, eager or compiled, so where a
  gradient is asked for on a device without one (`native_backward`), `attend` runs torch's
  forward through model/flex_cpu.py, whose backward is written there, block-sparse like it;
- uncompiled, flex_attention materializes every score (on a CPU 2-5x the time of a causal
  layer's forward and up to 20x its memory). Where torch.compile cannot build the kernel (no C
  compiler, no Triton), `attend` says so in one line and runs that: the same numbers, slowly.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import warnings

import torch

from ddpgpt.model import flex_cpu, fused

MODULE = "torch.nn.attention.flex_attention"
_loaded = None                      # the module, once imported
_compiled: dict[str, object] = {}   # device type -> torch.compile(flex_attention)
_uncompiled: dict[str, str] = {}    # device type -> why its kernel could not be compiled
_native: dict[str, bool] = {}       # device type -> whether torch has a backward there
CPU_FLEX_FROM = 2048                # auto's flex on a CPU: masked rows at least this long


def _module():
    """torch's FlexAttention module, or ImportError (torch < 2.5). Imported once, by
    `unavailable` when the model is built: an import inside a compiled model's forward would
    split its graph."""
    global _loaded
    if _loaded is None:
        _loaded = importlib.import_module(MODULE)
        _keep_out_of_graphs()
    return _loaded


def _keep_out_of_graphs() -> None:
    """torch.compiler.disable on the functions a compiled model runs rather than traces (_probe,
    _with_own_backward), applied once FlexAttention is first asked for (`unavailable`, as the
    model is built), not as this module is imported: it imports dynamo (~1 CPU s), which a
    process that only chooses the attention (the --nproc launcher's preflight) never uses."""
    global _probe, _with_own_backward
    if _probe is not _probe_run:  # done
        return
    _probe = torch.compiler.disable(_probe_run)
    _with_own_backward = torch.compiler.disable(_own_backward_run)


def unavailable() -> str:
    """Why this torch cannot run FlexAttention at all ("" when it can)."""
    global _loaded
    try:
        _loaded = importlib.import_module(MODULE)
    except ImportError:
        return (f"torch {torch.__version__} has no FlexAttention ({MODULE} came with torch 2.5); "
                "upgrade torch")
    _keep_out_of_graphs()
    if not torch._dynamo.is_dynamo_supported():
        return f"FlexAttention needs torch.compile, which torch {torch.__version__} lacks here"
    return ""


def native_backward(device_type: str) -> bool:
    """Whether torch runs FlexAttention's own backward on this device (else `attend` trains
    through flex_cpu's). CUDA does; elsewhere torch is asked, once a device."""
    if device_type == "cuda":
        return True
    if device_type not in _native:
        _native[device_type] = _probe(device_type)
    return _native[device_type]


def _probe_run(device_type: str) -> bool:
    """A 16-token forward and backward, which torch 2.13 refuses on a CPU at once
    (NotImplementedError; an older torch may refuse the device itself)."""
    q = torch.zeros(1, 1, 16, 16, device=device_type, requires_grad=True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "called without torch.compile": it is a probe
            _module().flex_attention(q, q, q).sum().backward()
    except Exception:  # noqa: BLE001 -- whatever torch raises, it has no backward here
        return False
    return True


def choose(setting: str, device_type: str, dropout: float = 0.0, rows: int = 0,
           masked: bool = False) -> str:
    """model.attention as `device_type` runs it: auto is flex where torch has FlexAttention and
    no attention dropout is asked for (FlexAttention has none) on CUDA, and on a CPU for masked
    (`masked`: model.doc_mask) rows of CPU_FLEX_FROM tokens or more, else sdpa. On a CPU, from
    docs/performance.md's figures: at 2,048 tokens flex (torch's compiled forward, flex_cpu's
    backward) trains a layer faster than the dense mask whatever the documents' length; at 1,024
    it wins with short documents and loses with long ones, at 256 it loses. sdpa and flex stay
    as set (`refusal` says where flex cannot train)."""
    if setting != "auto":
        return setting
    wanted = device_type == "cuda" or (device_type == "cpu" and masked and rows >= CPU_FLEX_FROM)
    # unavailable() (it imports dynamo) asked only where the answer would be flex
    return "flex" if wanted and not dropout and not unavailable() else "sdpa"


def refusal(device_type: str, dropout: float) -> str:
    """Why a run cannot train with model.attention flex on this device ("" when it can): every
    device trains through it, with torch's backward or flex_cpu's (`attend`)."""
    why = unavailable()
    if why:
        return f"model.attention = flex: {why}, or use model.attention sdpa (or auto)"
    if dropout:
        return (f"model.attention = flex has no attention dropout, and model.dropout = "
                f"{dropout:g}; use model.attention sdpa (or auto), or model.dropout 0")
    return ""


def block_mask(idx: torch.Tensor, bos_id: int | None, window: int = 0):
    """The BlockMask of the rows idx (B, T): query i may attend key j when j <= i, i - j < window
    (when `window`: the sliding band), and, with `bos_id`, no document starts (a bos_id token) in
    (j, i]: the segment of a token is the count of bos_id tokens up to it, as `documents` counts
    it. Without bos_id the mask is the same for every row (batch dimension 1)."""
    flex = _module()
    T = idx.size(1)
    segment = torch.cumsum(idx == bos_id, dim=1) if bos_id is not None else None  # (B, T)

    def allowed(b, h, i, j):
        keep = j <= i
        if window:
            keep = keep & (i - j < window)
        if segment is not None:
            keep = keep & (segment[b, i] == segment[b, j])
        return keep

    rows = idx.size(0) if segment is not None else None
    return flex.create_block_mask(allowed, rows, None, T, T, device=idx.device)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, gqa: bool) -> torch.Tensor:
    """flex_attention of q (B, H, T, D) over k, v (B, H_kv, T, D) under the BlockMask `mask`
    (`forward`), differentiable through flex_cpu's backward where a gradient is asked for and
    torch has none on this device."""
    if (q.requires_grad or k.requires_grad or v.requires_grad) and \
            not native_backward(q.device.type):
        if torch.is_grad_enabled():
            return _with_own_backward(q, k, v, mask, gqa)
        q, k, v = q.detach(), k.detach(), v.detach()  # torch refuses them even under no_grad
    return forward(q, k, v, mask, gqa)


def _own_backward_run(q, k, v, mask, gqa: bool) -> torch.Tensor:
    return flex_cpu.attention(q, k, v, mask, gqa, forward)


# Disabled for torch.compile once FlexAttention is loaded (_keep_out_of_graphs): the probe (a
# forward and a backward) is run, never traced into a compiled model; flex_cpu's attention is a
# graph break (the block lists are read as data).
_probe, _with_own_backward = _probe_run, _own_backward_run


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, gqa: bool) -> torch.Tensor:
    """torch's flex_attention, compiled (inside a compiled model, traced into its graph). Where
    torch.compile cannot build the kernel on this device, one line says so and the uncompiled
    FlexAttention runs from then on; inputs at fault fail the same way uncompiled, and raise."""
    flex = _module()
    kwargs = {"block_mask": mask, "enable_gqa": gqa}
    if torch.compiler.is_compiling():
        # Contiguous: torch 2.13's CPU kernel, handed a transposed view of a fused pointwise
        # result (QK-norm, the rotary turn, on (B, T, H, D)), computes wrong numbers.
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        return flex.flex_attention(q, k, v, **kwargs)
    device = q.device.type
    if device not in _uncompiled:
        if device not in _compiled:
            _compiled[device] = torch.compile(flex.flex_attention, dynamic=False)
        y, why = fused.attempt(lambda: _compiled[device](q, k, v, **kwargs),
                               lambda: _eager(flex, q, k, v, kwargs))
        if not why:
            return y
        _uncompiled[device] = why
        print(f"ddpgpt: model.attention flex: torch.compile cannot build FlexAttention's kernel "
              f"on {device} ({_uncompiled[device]}); running it uncompiled, which materializes "
              "every score: the same numbers, slower than model.attention sdpa", file=sys.stderr)
        return y
    return _eager(flex, q, k, v, kwargs)


@contextlib.contextmanager
def uncompiled(device_type: str):
    """Inside, `attend` runs FlexAttention uncompiled on this device, as where the compiler
    fails (the same numbers): for measuring it, and for tests that would compile every shape."""
    before = _uncompiled.get(device_type)
    _uncompiled[device_type] = "asked for"
    try:
        yield
    finally:
        if before is None:
            del _uncompiled[device_type]
        else:
            _uncompiled[device_type] = before


def _eager(flex, q, k, v, kwargs) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's "called without torch.compile": said above
        return flex.flex_attention(q, k, v, **kwargs)

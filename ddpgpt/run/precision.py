"""How a process runs a resolved config: its thread count (a sampling one's too), matmul
precision and allocator, and the mixed-precision context (autocast and, for fp16, a
GradScaler)."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
from dataclasses import dataclass

import torch

from ddpgpt.config.schema import RunConfig

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def configure(threads: int, device: torch.device) -> None:
    torch.set_num_threads(threads)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    if device.type == "cpu":
        keep_freed_memory()
        flush_denormals()


SMALL_STEP = 200e6  # parameters × samples: one thread below (see SampleConfig.threads)


def sampling_threads(work: float) -> int:
    """CPU threads to sample with (`sample`, `chat`), for `work` = parameters × rows sampled.
    Measured on a 2-core VM with another process busy, the tiny preset, 200 tokens: 1 thread
    3.0 s, 2 threads 19.9 s (idle: 3.0 s and 2.8 s). Each step is a few small matmuls; the
    threads wait on each other at every one of them."""
    return 1 if work < SMALL_STEP else max(1, len(os.sched_getaffinity(0)))


def flush_denormals() -> None:
    """On CPU: float results below float32's smallest normal (1.2e-38) are taken as zero.

    x86 computes with such subnormal numbers tens of times slower than with normal ones, and a
    trained model makes them: the tiny preset under Muon went from 8,650 to 5,400 tokens/s over
    its first 300 steps, and back to 8,600 with this (docs/performance.md, "Time to a loss").
    They are far below anything a loss or a gradient resolves. Where the CPU has no such mode
    (torch returns False), nothing changes."""
    torch.set_flush_denormal(True)


def keep_freed_memory() -> None:
    """On CPU with glibc: keep freed memory in the process for reuse (elsewhere a no-op).

    Every step allocates and frees the same large tensors (the (b·T, V) logits, their softmax and
    gradients: 32 MiB each for the tiny preset). glibc serves blocks that large with mmap and
    unmaps them on free, so each step page-faults them in again: ~38k faults, ~8% of a tiny CPU
    step, measured. With mmap and trimming off, freed blocks stay in the heap (+2% peak memory)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4
    libc.mallopt(M_MMAP_MAX, 0)
    libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1)


@dataclass(frozen=True)
class Precision:
    """The one decision of how a process computes: fp32, bf16 or fp16 on `device`. What follows
    from it is read here, never decided again: the autocast context, fp16's loss scaler, the matmul
    dtype (for the peak FLOPs of MFU), and Muon's Newton-Schulz dtype."""
    name: str              # fp32, bf16 or fp16 (never auto: a resolved config's)
    device: torch.device

    @classmethod
    def of(cls, run: RunConfig, device: torch.device) -> Precision:
        """A training's: its resolved config's."""
        return cls(run.precision, device)

    @classmethod
    def for_inference(cls, trained: RunConfig, device: torch.device) -> Precision:
        """The precision a run trained in, where this device runs it; else this device's
        default."""
        if device.type == trained.device and trained.precision != "auto":
            return cls(trained.precision, device)
        return cls("bf16" if device.type == "cuda" else "fp32", device)

    @property
    def autocast(self):
        """A context factory: autocast to bf16/fp16, or nothing for fp32."""
        if self.name == "fp32":
            return contextlib.nullcontext
        return functools.partial(torch.autocast, self.device.type, dtype=DTYPES[self.name])

    def scaler(self) -> torch.amp.GradScaler | None:
        """fp16's loss scaler (bf16 and fp32 need none)."""
        return torch.amp.GradScaler(self.device.type) if self.name == "fp16" else None

    @property
    def matmul_dtype(self) -> torch.dtype:
        return DTYPES.get(self.name, torch.float32)

    def newton_schulz_dtype(self, choice: str = "auto") -> torch.dtype:
        """Muon's iteration (optim.muon_ns_dtype): auto is fp32 for an fp32 run (exact
        comparisons), else bf16 as torch's."""
        if choice == "auto":
            choice = "fp32" if self.name == "fp32" else "bf16"
        return {"fp32": torch.float32, "bf16": torch.bfloat16}[choice]

"""The training rows of `ddpgpt check`: which runs each row compares, and how closely.

Every run trains the same small model from the same seed on the same global batches, so two runs
that differ only in how the gradients travel (the sync mode, W, compression, compile) must give
the same per-step losses up to float rounding, and a run in bf16 or fp16 the fp32 losses up to
the rounding of those formats. The oracles:

- the fp32 CPU run: the single-device model on one process, no process group, fp32 (`mode` None);
  ddp in each precision and optimizer is compared with it;
- ddp on the same device, W and precision: every other mode is compared with it;
- the same run without the option: compile and gradient compression are compared with it.

This module imports no torch: the plan is read by the report before anything runs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import get_args

from ddpgpt.config.choices import Optimizer
from ddpgpt.sync.modes import MODES

STEPS = 5          # optimizer steps per training run
SKIP_AT = 3        # the fp16 run's forced non-finite step (1-based)


@dataclass(frozen=True)
class Case:
    """One training run of the matrix (at the world size of the process group it runs in)."""
    mode: str | None            # None: the fp32 CPU run, one process, no group (the oracle)
    optim: str = "adamw"
    precision: str = "fp32"
    compile: bool = False
    compress: str = "none"
    skip_at: int = 0            # this step is forced non-finite and must be skipped
    speed: bool = False         # the speed model (tiny on CPU, gpt2-124m on CUDA), timed
    torch_hook: bool = False    # ddp with torch's bf16_compress_hook (NCCL only)
    arch: str = "gpt2"          # model.arch
    attention: str = "sdpa"     # model.attention
    align: str = "stream"       # data.align (bos: rows start at documents, the document mask)

    @property
    def name(self) -> str:
        parts = [self.mode or "fp32 CPU run", self.optim, self.precision]
        parts += ["compile"] * self.compile
        parts += [f"grad-compress {self.compress}"] * (self.compress != "none")
        parts += ["torch's bf16_compress_hook"] * self.torch_hook
        parts += [f"loss scaler · step {self.skip_at} forced non-finite"] * bool(self.skip_at)
        parts += [self.arch] * (self.arch != "gpt2")
        parts += ["documents"] * (self.align == "bos")
        parts += [self.attention] * (self.attention != "sdpa")
        return " · ".join(parts)


@dataclass(frozen=True)
class Spec:
    """A row: `case` compared with `oracle` (None: the row reads `case` alone), within `tol`."""
    check: str
    case: Case
    oracle: Case | None
    against: str
    tol: float
    kind: str = "losses"        # losses | speed | memory


# The largest relative difference of per-step losses each comparison allows, by the device and
# the precision of the run checked. Against the fp32 CPU run: fp32 on CPU differs only by the
# order of reductions; on CUDA matmuls run in TF32 (10-bit mantissa); bf16 (8 bits) and fp16
# (11 bits) round every matmul input. Against ddp on the same device: the same arithmetic, the
# gradients reduced in another order (and bf16 casts of weights that differ in their last bits).
VS_FP32_CPU = {("cpu", "fp32"): 1e-5, ("cuda", "fp32"): 2e-3,
               ("cpu", "bf16"): 2e-2, ("cuda", "bf16"): 2e-2,
               ("cpu", "fp16"): 1e-2, ("cuda", "fp16"): 1e-2}
VS_DDP = {("cpu", "fp32"): 1e-5, ("cuda", "fp32"): 1e-3,
          ("cpu", "bf16"): 1e-2, ("cuda", "bf16"): 1e-2}
VS_EAGER = {"fp32": 1e-4, "bf16": 1e-2}   # compile fuses kernels: other roundings
COMPRESS = 2e-3                          # gradients rounded to bf16 on the wire


def default_precision(device: str) -> str:
    return "bf16" if device == "cuda" else "fp32"


def plan(device: str, world: int, quick: bool) -> list[Spec]:
    """Every training row at world size `world` on `device`. `quick`: one compile row (ddp, fp32,
    W=1): each new graph's compile takes 15-40 s on a 2-core CPU."""
    specs = []
    where = f"ddp, {device}, W={world}"
    for mode, row in MODES.items():
        for precision in ("fp32", "bf16"):
            for optim in get_args(Optimizer):
                case = Case(mode, optim, precision)
                if mode == "ddp":
                    specs.append(Spec(f"{mode} · {optim} · {precision}", case, Case(None, optim),
                                      "the fp32 CPU run", VS_FP32_CPU[device, precision]))
                else:
                    specs.append(Spec(f"{mode} · {optim} · {precision}", case,
                                      Case("ddp", optim, precision), where,
                                      VS_DDP[device, precision]))
            if not quick or (mode, world, precision) == ("ddp", 1, "fp32"):
                eager = Case(mode, "adamw", precision)
                specs.append(Spec(f"{mode} · adamw · {precision} · compile",
                                  Case(mode, "adamw", precision, compile=True), eager,
                                  "the same, eager", VS_EAGER[precision]))
        if row.compression:
            specs.append(Spec(f"{mode} · adamw · fp32 · grad-compress bf16",
                              Case(mode, compress="bf16"), Case(mode), "the same, fp32 on the wire",
                              COMPRESS))
        if mode == "ddp":  # torch's own hook, NCCL only: the oracle of ours where it runs
            specs.append(Spec("ddp · adamw · fp32 · torch's bf16_compress_hook",
                              Case(mode, torch_hook=True), Case(mode, compress="bf16"),
                              "ddp · grad-compress bf16 (ours)", COMPRESS))
        if row.loss_scaler:
            specs.append(Spec(f"{mode} · adamw · fp16 · loss scaler · step {SKIP_AT} forced "
                              "non-finite", Case(mode, precision="fp16", skip_at=SKIP_AT),
                              Case(None, skip_at=SKIP_AT),
                              f"the fp32 CPU run, step {SKIP_AT} skipped",
                              VS_FP32_CPU[device, "fp16"]))
    specs += modern(device, world, quick)
    specs += documents(device)
    precision = default_precision(device)
    ddp = Case("ddp", precision=precision, speed=True)
    for mode in MODES:
        case = Case(mode, precision=precision, speed=True)
        if mode == "ddp":  # the first loss: the same weights and batch before any update
            specs.append(Spec("speed ddp", case, Case(None, speed=True),
                              "the fp32 CPU run: its first loss", VS_FP32_CPU[device, precision],
                              kind="speed"))
        else:
            specs.append(Spec(f"speed {mode}", case, ddp, f"{where}: its losses",
                              VS_DDP[device, precision], kind="speed"))
        table = "the mode table's bytes per parameter"
        specs.append(Spec(f"peak memory {mode}", case, None if mode == "ddp" else ddp,
                          table if mode == "ddp" else f"{table}; {where}'s peak", 0.0,
                          kind="memory"))
    return specs


def modern(device: str, world: int, quick: bool) -> list[Spec]:
    """The modern arch (model.arch modern: rotary, RMSNorm, QK-norm, SwiGLU, untied head) held to
    the same oracles, with Muon, as it is trained: each mode in fp32; ddp in bf16 and fp16;
    compile (not with quick). (AdamW at the rows' lr of 1e-2 spikes at step 4 on the untied,
    zero-initialized model, and a spike magnifies bf16's rounding into a 1.5e-2 difference.)"""
    specs, where, fp32 = [], f"ddp, {device}, W={world}", Case(None, "muon", arch="modern")
    for mode in MODES:
        case = Case(mode, "muon", arch="modern")
        if mode == "ddp":
            specs.append(Spec("ddp · muon · fp32 · modern", case, fp32,
                              "the fp32 CPU run, modern", VS_FP32_CPU[device, "fp32"]))
        else:
            specs.append(Spec(f"{mode} · muon · fp32 · modern", case,
                              Case("ddp", "muon", arch="modern"), f"{where}, modern",
                              VS_DDP[device, "fp32"]))
    for precision in ("bf16", "fp16"):
        specs.append(Spec(f"ddp · muon · {precision} · modern",
                          Case("ddp", "muon", precision, arch="modern"), fp32,
                          "the fp32 CPU run, modern", VS_FP32_CPU[device, precision]))
    if not quick:
        specs.append(Spec("ddp · muon · fp32 · compile · modern",
                          Case("ddp", "muon", compile=True, arch="modern"),
                          Case("ddp", "muon", arch="modern"), "the same, eager",
                          VS_EAGER["fp32"]))
    return specs


def documents(device: str) -> list[Spec]:
    """Rows that start at documents (data.align bos, the document mask) trained through
    FlexAttention's block mask, against the same run under SDPA's dense mask: the same numbers
    by another kernel (on a CPU through model/flex_cpu.py's backward, torch having none)."""
    specs = []
    for optim, precision, arch in (("adamw", "fp32", "gpt2"), ("adamw", "bf16", "gpt2"),
                                   ("muon", "fp32", "modern")):
        dense = Case("ddp", optim, precision, arch=arch, align="bos")
        case = dataclasses.replace(dense, attention="flex")
        specs.append(Spec(case.name, case, dense, "the same, sdpa's dense mask",
                          VS_DDP[device, precision]))
    return specs


def cases(specs: list[Spec]) -> list[Case]:
    """Every run the rows read, each once, oracles first."""
    seen: dict[Case, None] = {}
    for spec in specs:
        for case in (spec.oracle, spec.case):
            if case is not None:
                seen.setdefault(case)
    return sorted(seen, key=lambda c: (c.mode is not None, c.speed))

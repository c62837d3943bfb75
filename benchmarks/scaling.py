"""What each gradient-sync mode costs past this machine, on paper: bytes, time, exposure, memory.

    python -m benchmarks.scaling [--world 8] [--out docs/scaling.png]

Prints the "Scaling out" tables of docs/sync.md and draws them. Everything here is a formula; the
inputs are stated, and the only measured one is the compute speed (the H100 figure in
docs/performance.md). For each model (gpt2-124m, gpt2-350m, and a 1.3B config of GPT-3 XL's shape:
24 layers, 2048 wide, 16 heads), at W ranks with G = 512 sequences of 1024 tokens per step:

- bytes each rank sends per step: the mode table's ring formulas (`ddpgpt.sync.MODES`, what
  `ddpgpt bench` prints), fp32 gradients and parameters, or bf16 gradients with
  --run.grad-compress bf16;
- the time that takes at a per-rank bus bandwidth of 450 GB/s (NVLink 4, one H100 node),
  50 GB/s (a 400 Gb/s InfiniBand NIC per GPU) and 12.5 GB/s (100 Gb/s Ethernet per GPU);
- the compute time per step: the model's training FLOPs for the rank's G·T/W tokens at 405 TFLOP/s
  (40.9% of the H100's 989 TFLOP/s bf16 peak: what gpt2-124m measured, compiled, b=64, in
  docs/performance.md);
- the exposed share: the part of the communication that no computation hides, over the step. The
  ring's work is modelled per mode as ddpgpt schedules it (`exposed` in the mode table): ddp and
  allreduce all-reduce during the last micro-step's backward (2/3 of a micro-step's compute);
  rs-ag reduce-scatters there and
  all-gathers after it; zero1 reduce-scatters there and all-gathers the updated parameters after
  the optimizer step; fsdp2 all-gathers each micro-step's parameters during its forward (1/3) and
  again during its backward (2/3), and reduce-scatters in the last backward. Latency, the first
  and last bucket, and the GPU's own slowdown while it communicates are left out: the model is
  a lower bound on exposure;
- the largest model whose parameters, gradients and AdamW state fit in 70 GB of an 80 GB GPU (10 GB
  left for activations, workspace and fragmentation): bytes per parameter per rank are 16 for ddp,
  allreduce and rs-ag (4 weights, 4 gradients, 8 moments; the gradients are the bucket buffers),
  8 + 12/W for zero1 (full weights and gradients, 1/W of the moments and a 1/W gradient shard),
  16/W for fsdp2 plus, for a moment, two blocks' full weights and gradients. That is at A=1: with
  A>1 fsdp2 skips the reduce-scatter before the last micro-step, so every rank holds whole fp32
  gradients until then (4 + 12/W bytes per parameter).

Then Muon for one model (`print_muon`, gpt2-124m at --world): the owners' balance (muon.plan,
max/mean Newton-Schulz cost per rank) at several W, the momentum and Newton-Schulz FLOPs of the
busiest owner against every rank doing every matrix, and each mode's bytes and exposure with
Muon against AdamW: ddp, allreduce and rs-ag add an all-gather of the owners' new matrices after
the step; zero1 moves its matrices whole inside its reduce-scatter and all-gather; fsdp2 adds two
all-to-alls of 1/W of the matrices between the backward and the step.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from ddpgpt.config.model import ModelConfig
from ddpgpt.model.gpt import GPT
from ddpgpt.optim.muon import plan
from ddpgpt.optim.optimizer import is_muon_param
from ddpgpt.sync.modes import MODES, Traffic

MODELS = {  # name: (shape, micro-batch b a GPU fits, as the presets choose)
    "gpt2-124m": (dict(n_layer=12, n_head=12, n_embd=768), 16),
    "gpt2-350m": (dict(n_layer=24, n_head=16, n_embd=1024), 8),
    "1.3B": (dict(n_layer=24, n_head=16, n_embd=2048), 4),
}
FABRICS = {"NVLink 450 GB/s": 450e9, "InfiniBand 400 Gb/s": 50e9, "Ethernet 100 Gb/s": 12.5e9}
SEQUENCES, T, FLOPS = 512, 1024, 0.409 * 989e12
GPU_BYTES = 70e9
BLOCKS = 24  # fsdp2's two whole blocks while they compute, for a model of this many blocks


def model_numbers(shape: dict) -> tuple[int, float, list[tuple[int, int]]]:
    """Parameters, training FLOPs per token, and the shapes of Muon's matrices."""
    with torch.device("meta"):
        model = GPT(ModelConfig(block_size=T, vocab_size=50304, **shape))
    matrices = [tuple(p.shape) for n, p in model.named_parameters() if is_muon_param(n, p)]
    return model.num_params(non_embedding=False), model.flops_per_token(T), matrices


def traffic(n: int, world: int, accum: int, compress: bool = False,
            matrices: list[tuple[int, int]] = ()) -> Traffic:
    """The mode table's inputs; with `matrices`, Muon's, laid out by owner."""
    return Traffic(n, world, accum, 2 if compress else 4,
                   matrices=sum(r * c for r, c in matrices),
                   padded=plan(list(matrices), world).padded() if matrices else 0)


def exposed(mode: str, t: Traffic, bandwidth: float, step_s: float) -> float:
    """Seconds per step that the mode's traffic is not hidden behind compute (sync.MODES)."""
    return MODES[mode].exposed(t, bandwidth, step_s / t.accum)


def share(exposed_s: float, compute_s: float) -> float:
    """The part of a step spent waiting on communication."""
    return exposed_s / (compute_s + exposed_s)


def largest_model(mode: str, world: int) -> float:
    """Parameters whose weights, gradients and AdamW state fit in GPU_BYTES (sync.MODES)."""
    return GPU_BYTES / MODES[mode].memory(world, BLOCKS)


def tables(world: int, muon: bool = False) -> dict:
    rows = {}
    for name, (shape, micro) in MODELS.items():
        n, flops_per_token, matrices = model_numbers(shape)
        accum = max(1, SEQUENCES // (world * micro))
        step_s = SEQUENCES * T / world * flops_per_token / FLOPS
        rows[name] = {"params": n, "accum": accum, "step_s": step_s, "modes": {}}
        for mode in (*MODES, "ddp+bf16"):
            base, compress = mode.split("+")[0], mode.endswith("bf16")
            t = traffic(n, world, accum, compress, matrices if muon else ())
            sent = MODES[base].sent(t)
            rows[name]["modes"][mode] = {
                "sent": sent,
                "time": {f: sent / bw for f, bw in FABRICS.items()},
                "exposed": {f: share(exposed(base, t, bw, step_s), step_s)
                            for f, bw in FABRICS.items()},
            }
    return rows


def print_tables(rows: dict, world: int) -> None:
    print(f"W = {world}, G = {SEQUENCES} × {T} tokens, compute at {FLOPS / 1e12:.0f} TFLOP/s\n")
    fabrics = list(FABRICS)
    print("| model | mode | GB sent per rank per step | " + " | ".join(
        f"{f}: ms (exposed share of the step)" for f in fabrics) + " |")
    print("|---|---|---:|" + "---:|" * len(fabrics))
    for name, r in rows.items():
        label = (f"{name} ({r['params'] / 1e6:,.0f}M, A={r['accum']}, "
                 f"compute {r['step_s'] * 1e3:,.0f} ms)")
        for mode, m in r["modes"].items():
            if mode == "allreduce":
                continue  # the same bytes and schedule as ddp
            cells = [f"{m['time'][f] * 1e3:,.1f} ({m['exposed'][f]:.0%})" for f in fabrics]
            mode = "ddp, allreduce" if mode == "ddp" else mode
            print(f"| {label} | {mode} | {m['sent'] / 1e9:.2f} | " + " | ".join(cells) + " |")
            label = ""
    print("\n| mode | bytes per parameter per rank | largest model in 70 GB, W=8 | W=64 |")
    print("|---|---|---:|---:|")
    for mode in MODES:
        per = {"zero1": "8 + 12/W", "fsdp2": "16/W + two blocks (A=1)"}.get(mode, "16")
        print(f"| {mode} | {per} | {largest_model(mode, 8) / 1e9:.1f}B | "
              f"{largest_model(mode, 64) / 1e9:.1f}B |")


def ns_flops(shape: tuple[int, int], steps: int = 5) -> float:
    """One Newton-Schulz of a (rows, cols) matrix, m = the short side: per iteration X·Xᵀ and
    (gram)·X at 2·m²·n each, gram² at 2·m³."""
    m, n = sorted(shape)
    return steps * (4 * m * m * n + 2 * m ** 3)


def print_muon(world: int, name: str = "gpt2-124m") -> None:
    """Muon by owners for one model: balance, state, Newton-Schulz time and bytes per mode."""
    shape, micro = MODELS[name]
    n, flops_per_token, matrices = model_numbers(shape)
    accum = max(1, SEQUENCES // (world * micro))
    step_s = SEQUENCES * T / world * flops_per_token / FLOPS
    m = sum(r * c for r, c in matrices)
    print(f"\nMuon, {name}: {len(matrices)} matrices, {m / 1e6:.1f}M of {n / 1e6:.1f}M "
          "parameters; owners by Newton-Schulz cost (max/mean per rank):")
    print("| W | " + " | ".join(str(w) for w in (2, 4, 8, 16, 64)) + " |")
    print("|---|" + "---:|" * 5)
    print("| max/mean | " + " | ".join(f"{plan(matrices, w).balance():.3f}"
                                      for w in (2, 4, 8, 16, 64)) + " |")
    layout = plan(matrices, world)
    work = max(sum(ns_flops(matrices[i]) for i in layout.owned(r)) for r in range(world))
    everything = sum(ns_flops(s) for s in matrices)
    largest = max(layout.elements(r) for r in range(world))
    print(f"\nAt W = {world}: Muon's momentum {4 * largest / 1e6:.0f} MB on the largest owner "
          f"(all {len(matrices)} matrices' on every rank: {4 * m / 1e6:.0f} MB); Newton-Schulz "
          f"{work / 1e9:.0f} GFLOP on the busiest rank (all of them: {everything / 1e9:.0f}), "
          f"{work / FLOPS * 1e3:.2f} ms at {FLOPS / 1e12:.0f} TFLOP/s (a lower bound: matmuls "
          f"this small run slower), {work / FLOPS / step_s:.1%} of the {step_s * 1e3:.0f} ms "
          "step.\n")
    fabrics = list(FABRICS)
    print("| mode | GB sent per rank per step, AdamW | Muon | " + " | ".join(
        f"{f}: Muon exposed (AdamW)" for f in fabrics) + " |")
    print("|---|---:|---:|" + "---:|" * len(fabrics))
    plain, muon = traffic(n, world, accum), traffic(n, world, accum, matrices=matrices)
    for mode in MODES:
        cells = [f"{share(exposed(mode, muon, bw, step_s), step_s):.0%} "
                 f"({share(exposed(mode, plain, bw, step_s), step_s):.0%})"
                 for bw in FABRICS.values()]
        print(f"| {mode} | {MODES[mode].sent(plain) / 1e9:.2f} | "
              f"{MODES[mode].sent(muon) / 1e9:.2f} | " + " | ".join(cells) + " |")


def plot(rows: dict, world: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, (sent, exposure, fits) = plt.subplots(1, 3, figsize=(15, 5.4))
    modes = [*MODES, "ddp+bf16"]
    width = 0.8 / len(rows)
    for i, (name, r) in enumerate(rows.items()):
        xs = [k + i * width for k in range(len(modes))]
        sent.bar(xs, [r["modes"][m]["sent"] / 1e9 for m in modes], width, label=name)
    sent.set_xticks([k + width for k in range(len(modes))], modes, rotation=30)
    sent.set_ylabel(f"GB sent per rank per step (W={world})")
    sent.set_yscale("log")
    sent.legend()

    # Exposure against A for gpt2-124m under ddp: the same bytes, a shorter last backward.
    n, flops_per_token, _ = model_numbers(MODELS["gpt2-124m"][0])
    step_s = SEQUENCES * T / world * flops_per_token / FLOPS
    accums = [1, 2, 4, 8, 16, 32, 64]
    for (fabric, bw), colour in zip(FABRICS.items(), ("tab:green", "tab:blue", "tab:red")):
        for mode, style in (("ddp", "-"), ("ddp+bf16", "--"), ("fsdp2", ":")):
            base, compress = mode.split("+")[0], mode.endswith("bf16")
            values = [share(exposed(base, traffic(n, world, a, compress), bw, step_s), step_s)
                      * 100 for a in accums]
            exposure.plot(accums, values, style, color=colour, marker=".",
                          label=f"{mode}, {fabric}")
    exposure.set_xscale("log", base=2)
    exposure.set_xlabel("micro-steps per step A (same G)")
    exposure.set_ylabel("exposed communication, % of the step")
    exposure.set_title(f"gpt2-124m, W={world}")
    exposure.legend(fontsize=7, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.2))

    worlds = [2, 4, 8, 16, 32, 64]  # at W=1 every mode is the plain model
    for mode in ("ddp", "zero1", "fsdp2"):
        fits.plot(worlds, [largest_model(mode, w) / 1e9 for w in worlds], marker="o", label=mode)
    fits.set_xscale("log", base=2)
    fits.set_yscale("log")
    fits.set_xlabel("world size W")
    fits.set_ylabel("largest model, B parameters (states in 70 GB)")
    plain = matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}")
    fits.yaxis.set_major_formatter(plain)
    fits.yaxis.set_minor_formatter(plain)
    fits.legend()
    fig.suptitle("ddpgpt sync modes on paper: ring bytes, exposure, memory")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"\nwrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=8)
    parser.add_argument("--out", default="docs/scaling.png")
    args = parser.parse_args()
    rows = tables(args.world)
    print_tables(rows, args.world)
    print_muon(args.world)
    plot(rows, args.world, Path(args.out))


if __name__ == "__main__":
    main()

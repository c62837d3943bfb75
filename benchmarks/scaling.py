"""What each gradient-sync mode costs past this machine, on paper: bytes, time, exposure, memory.

    python -m benchmarks.scaling [--world 8] [--out docs/scaling.png]

Prints the "Scaling out" tables of docs/sync.md and draws them. Everything here is a formula; the
inputs are stated, and the only measured one is the compute speed (the H100 figure in
docs/performance.md). For each model (gpt2-124m, gpt2-350m, and a 1.3B config of GPT-3 XL's shape:
24 layers, 2048 wide, 16 heads), at W ranks with G = 512 sequences of 1024 tokens per step:

- bytes each rank sends per step: `ddpgpt.bench.sent_bytes`, the ring formulas `ddpgpt bench`
  prints (fp32 gradients and parameters, or bf16 gradients with --run.grad-compress bf16);
- the time that takes at a per-rank bus bandwidth of 450 GB/s (NVLink 4, one H100 node),
  50 GB/s (a 400 Gb/s InfiniBand NIC per GPU) and 12.5 GB/s (100 Gb/s Ethernet per GPU);
- the compute time per step: the model's training FLOPs for the rank's G·T/W tokens at 405 TFLOP/s
  (40.9% of the H100's 989 TFLOP/s bf16 peak: what gpt2-124m measured, compiled, b=64, in
  docs/performance.md);
- the exposed share: the part of the communication that no computation hides, over the step. The
  ring's work is modelled per mode as ddpgpt schedules it: ddp and allreduce all-reduce during
  the last micro-step's backward (2/3 of a micro-step's compute); rs-ag reduce-scatters there and
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
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from ddpgpt.bench import sent_bytes
from ddpgpt.config import ModelConfig
from ddpgpt.model import GPT

MODES = ("ddp", "allreduce", "rs-ag", "zero1", "fsdp2")
MODELS = {  # name: (shape, micro-batch b a GPU fits, as the presets choose)
    "gpt2-124m": (dict(n_layer=12, n_head=12, n_embd=768), 16),
    "gpt2-350m": (dict(n_layer=24, n_head=16, n_embd=1024), 8),
    "1.3B": (dict(n_layer=24, n_head=16, n_embd=2048), 4),
}
FABRICS = {"NVLink 450 GB/s": 450e9, "InfiniBand 400 Gb/s": 50e9, "Ethernet 100 Gb/s": 12.5e9}
SEQUENCES, T, FLOPS = 512, 1024, 0.409 * 989e12
GPU_BYTES = 70e9


def model_numbers(shape: dict) -> tuple[int, float]:
    """Parameters and training FLOPs per token."""
    with torch.device("meta"):
        model = GPT(ModelConfig(block_size=T, vocab_size=50304, **shape))
    return model.num_params(non_embedding=False), model.flops_per_token(T)


def exposed(mode: str, n: int, world: int, accum: int, bandwidth: float, step_s: float,
            compress: bool = False) -> float:
    """Seconds per step that the ring's traffic is not hidden behind compute (see module doc)."""
    fraction = (world - 1) / world
    grad_s = fraction * n * (2 if compress else 4) / bandwidth  # one pass over the gradients
    weight_s = fraction * n * 4 / bandwidth                     # one pass over fp32 weights
    micro = step_s / accum
    forward, backward = micro / 3, 2 * micro / 3
    if mode in ("ddp", "allreduce"):
        return max(0.0, 2 * grad_s - backward)
    if mode == "rs-ag":
        return max(0.0, grad_s - backward) + grad_s
    if mode == "zero1":
        return max(0.0, grad_s - backward) + weight_s
    if mode == "fsdp2":  # A-1 micro-steps without the reduce-scatter, then the last one with it
        plain = max(0.0, weight_s - forward) + max(0.0, weight_s - backward)
        return (accum - 1) * plain + max(0.0, weight_s - forward) + max(
            0.0, weight_s + grad_s - backward)
    raise ValueError(mode)


def share(exposed_s: float, compute_s: float) -> float:
    """The part of a step spent waiting on communication."""
    return exposed_s / (compute_s + exposed_s)


def state_bytes_per_param(mode: str, world: int) -> float:
    return {"zero1": 8 + 12 / world, "fsdp2": 16 / world}.get(mode, 16)


def largest_model(mode: str, world: int) -> float:
    """Parameters (of a 24-layer model, for fsdp2's two full blocks) that fit in GPU_BYTES."""
    if mode != "fsdp2":
        return GPU_BYTES / state_bytes_per_param(mode, world)
    # n parameters in 24 equal blocks: n·16/W + 2·(n/24)·8 (two blocks' weights and gradients)
    return GPU_BYTES / (16 / world + 2 * 8 / 24)


def tables(world: int) -> dict:
    rows = {}
    for name, (shape, micro) in MODELS.items():
        n, flops_per_token = model_numbers(shape)
        accum = max(1, SEQUENCES // (world * micro))
        step_s = SEQUENCES * T / world * flops_per_token / FLOPS
        rows[name] = {"params": n, "accum": accum, "step_s": step_s, "modes": {}}
        for mode in (*MODES, "ddp+bf16"):
            base, compress = mode.split("+")[0], mode.endswith("bf16")
            sent = sent_bytes(base, n, world, accum, compress)
            rows[name]["modes"][mode] = {
                "sent": sent,
                "time": {f: sent / bw for f, bw in FABRICS.items()},
                "exposed": {f: share(exposed(base, n, world, accum, bw, step_s, compress),
                                     step_s) for f, bw in FABRICS.items()},
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
    n, flops_per_token = model_numbers(MODELS["gpt2-124m"][0])
    step_s = SEQUENCES * T / world * flops_per_token / FLOPS
    accums = [1, 2, 4, 8, 16, 32, 64]
    for (fabric, bw), colour in zip(FABRICS.items(), ("tab:green", "tab:blue", "tab:red")):
        for mode, style in (("ddp", "-"), ("ddp+bf16", "--"), ("fsdp2", ":")):
            base, compress = mode.split("+")[0], mode.endswith("bf16")
            values = [share(exposed(base, n, world, a, bw, step_s, compress), step_s) * 100
                      for a in accums]
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
    plot(rows, args.world, Path(args.out))


if __name__ == "__main__":
    main()

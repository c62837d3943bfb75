"""Training throughput and MFU of the real `ddpgpt train` path: CPU weak scaling W=1 -> W=2, or one GPU.

    python -m benchmarks.bench_train [--data data/stdlib] [--preset tiny] [--steps 40] [--json out.json]
    python -m benchmarks.bench_train --gpu      # gpt2-124m, W=1, bf16, --compile; skips without CUDA

CPU mode. Each figure comes from a subprocess `python -m ddpgpt train --device cpu --run.threads 1
--run.eval-every 0 --run.checkpoint-every 0` in a temporary run dir, plain at W=1 and `--nproc 2`
(torch's elastic launcher, gloo) at W=2. The first --warmup rows of its metrics.jsonl are dropped
and the median of the rest is reported; the end-of-run evaluation and checkpoint still happen, but
metrics.paused() keeps them out of tokens_per_s (and --data.eval-windows 16 keeps them short).

Weak scaling holds the work of each process fixed. W=2 trains the preset's global batch G, so each
process runs A = G / (2·b) micro-steps of b sequences per step; W=1 trains G/2, so its one process
runs the same A micro-steps of the same b. Per-process tokens/s should then be the same at W=1 and
W=2, and efficiency = (W=2 total tokens/s) / (2 × W=1 tokens/s) measures what data parallelism
costs: the gradient all-reduce once per step, the logged loss's all-reduce, and two processes
sharing the caches and memory of one machine. (Strong scaling, a fixed G, would instead halve A.)

MFU = per-process tokens/s × the model's training FLOPs per token (GPT.flops_per_token) / peak,
where peak is measured here first: `measure_matmul_flops` (fp32 1024³ matmul, one thread, as the
training loop measures it), best of 5 windows of 0.3 s, since on a shared VM a single window can
read low. The runs' own `mfu` column (against their one window) is printed alongside. The share of
the CPUs taken by other processes during each run is printed too: above a few percent, the run
competed for its cores and its figures read low.

GPU mode runs gpt2-124m at W=1 (bf16 autocast, torch.compile, the preset's G and b) and reports
tokens/s and the `mfu` column, which there is against the GPU's data-sheet bf16 peak.

Targets: MFU >= 80%, weak-scaling efficiency >= 95%.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from ddpgpt.config import from_dict
from ddpgpt.metrics import measure_matmul_flops, peak_flops
from ddpgpt.model import GPT
from ddpgpt.presets import get_preset

MFU_TARGET, EFFICIENCY_TARGET = 0.80, 0.95


def cpu_busy_s() -> float | None:
    """Seconds of CPU time spent by all processes so far (from /proc/stat), or None off Linux."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return None
    ticks = [int(v) for v in fields]
    idle = ticks[3] + ticks[4]  # idle + iowait
    return (sum(ticks[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def children_cpu_s() -> float:
    t = os.times()
    return t.children_user + t.children_system


def train(data: str, preset: str, world: int, steps: int, extra: list[str]) -> dict:
    """Runs `ddpgpt train` in a fresh run dir; returns its metrics rows, resolved config, wall
    time and the share of the CPUs that other processes took meanwhile."""
    with tempfile.TemporaryDirectory(prefix="bench_train_") as run_dir:
        cmd = [sys.executable, "-m", "ddpgpt", "train", "--data", data, "--preset", preset,
               "--run-dir", run_dir, "--run.steps", str(steps), "--run.log-every", "1",
               "--run.eval-every", "0", "--run.checkpoint-every", "0", "--data.eval-windows", "16",
               *extra, *(["--nproc", str(world)] if world > 1 else [])]
        busy0, own0, start = cpu_busy_s(), children_cpu_s(), time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wall = time.perf_counter() - start
        # Children's CPU time counts the launcher's workers too: they are waited for before it exits.
        own, busy = children_cpu_s() - own0, cpu_busy_s()
        if proc.returncode:
            sys.exit(f"bench_train: `{' '.join(cmd)}` failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
        config = json.loads((Path(run_dir) / "config.json").read_text())
    other = None if busy is None else max(0.0, (busy - busy0 - own) / (wall * os.cpu_count()))
    return {"rows": [r for r in rows if "tokens_per_s" in r], "config": config, "wall_s": wall,
            "other_cpu_share": other}


def summarize(run: dict, world: int, warmup: int, peak: float | None) -> dict:
    """Medians over the rows after warm-up: tokens/s per process and MFU (against `peak` when
    given) plus the run's own mfu column."""
    rows = run["rows"][warmup:]
    if len(rows) < 3:
        sys.exit(f"bench_train: only {len(rows)} rows after {warmup} warm-up steps; raise --steps")
    cfg = from_dict(run["config"])
    tps = statistics.median(r["tokens_per_s"] for r in rows) / world
    out = {"world_size": world, "steps_measured": len(rows), "tokens_per_s_per_process": tps,
           "mfu_column": statistics.median(r["mfu"] for r in rows), "wall_s": run["wall_s"],
           "other_cpu_share": run["other_cpu_share"], "global_batch": cfg.data.global_batch,
           "micro_batch": cfg.data.micro_batch,
           "accum_steps": cfg.data.global_batch // (world * cfg.data.micro_batch)}
    if peak is not None:
        flops_per_token = GPT(cfg.model).flops_per_token(cfg.seq_len)
        out["flops_per_token"] = flops_per_token
        out["mfu"] = tps * flops_per_token / peak
    return out


def verdict(value: float, target: float) -> str:
    return f"target >= {target:.0%}: {'met' if value >= target else 'NOT met'}"


def line(r: dict) -> str:
    other = "" if r["other_cpu_share"] is None else f"; other processes took {r['other_cpu_share']:.0%} of the CPUs"
    return (f"  W={r['world_size']}: {r['tokens_per_s_per_process']:8,.0f} tokens/s per process   "
            f"MFU {r['mfu']:6.1%}  (mfu column {r['mfu_column']:.1%}; A={r['accum_steps']} × "
            f"b={r['micro_batch']}, G={r['global_batch']}; median of {r['steps_measured']} steps{other})")


def bench_cpu(a: argparse.Namespace) -> dict:
    preset = a.preset or "tiny"
    G, b = get_preset(preset).data.global_batch, get_preset(preset).data.micro_batch
    if G % (2 * b):
        sys.exit(f"bench_train: preset {preset} has G={G}, not a multiple of 2 × b={b}; weak scaling needs it")
    # 1. The peak, before any run: one thread, as every training process measures it.
    torch.set_num_threads(1)
    peak = max(measure_matmul_flops(torch.device("cpu")) for _ in range(5))
    print(f"bench_train: {preset}, CPU, 1 thread per process; matmul peak {peak / 1e9:.1f} GFLOP/s per process "
          f"(fp32 1024³, best of 5 × 0.3 s)", flush=True)
    # 2. The same per-process work at both sizes: W=1 trains G/2, W=2 trains G.
    flags = ["--device", "cpu", "--run.threads", "1"]
    results = {}
    for world, global_batch in ((1, G // 2), (2, G)):
        run = train(a.data, preset, world, a.steps, [*flags, "--data.global-batch", str(global_batch)])
        results[world] = summarize(run, world, a.warmup, peak)
        print(line(results[world]), flush=True)
    w1, w2 = results[1], results[2]
    efficiency = w2["tokens_per_s_per_process"] / w1["tokens_per_s_per_process"]
    print(f"  weak-scaling efficiency (W=2 total / 2 × W=1): {efficiency:.1%}   "
          f"{verdict(efficiency, EFFICIENCY_TARGET)}")
    print(f"  MFU W=1 {w1['mfu']:.1%}, W=2 {w2['mfu']:.1%}   {verdict(min(w1['mfu'], w2['mfu']), MFU_TARGET)}")
    return {"mode": "cpu", "preset": preset, "peak_flops_per_process": peak, "w1": w1, "w2": w2,
            "efficiency": efficiency, "mfu_target": MFU_TARGET, "efficiency_target": EFFICIENCY_TARGET,
            "mfu_met": min(w1["mfu"], w2["mfu"]) >= MFU_TARGET, "efficiency_met": efficiency >= EFFICIENCY_TARGET}


def bench_gpu(a: argparse.Namespace) -> dict | None:
    if not torch.cuda.is_available():
        print("bench_train --gpu: skipped, CUDA is not available")
        return None
    preset = a.preset or "gpt2-124m"
    peak = peak_flops(torch.device("cuda"), torch.bfloat16)  # what the runs' mfu column divides by
    name = torch.cuda.get_device_name()
    print(f"bench_train: {preset}, W=1 on {name}, bf16, compiled; peak {peak / 1e12:.0f} TFLOP/s "
          "(data sheet, or measured if the GPU is not in metrics.GPU_BF16_PEAK)", flush=True)
    run = train(a.data, preset, 1, a.steps, ["--device", "cuda", "--run.precision", "bf16", "--compile"])
    r = summarize(run, 1, a.warmup, None)  # the first steps include compilation
    print(f"  {r['tokens_per_s_per_process']:,.0f} tokens/s   MFU {r['mfu_column']:.1%}   "
          f"{verdict(r['mfu_column'], MFU_TARGET)}   (A={r['accum_steps']} × b={r['micro_batch']}, "
          f"median of {r['steps_measured']} steps)")
    return {"mode": "gpu", "preset": preset, "device": name, "peak_flops": peak, "w1": r, "mfu_target": MFU_TARGET}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default="data/stdlib")
    p.add_argument("--preset", help="default: tiny on CPU, gpt2-124m with --gpu")
    p.add_argument("--steps", type=int, help="optimizer steps per run (default: 40 on CPU, 30 with --gpu)")
    p.add_argument("--warmup", type=int, default=5, help="first steps of each run left out of the medians")
    p.add_argument("--gpu", action="store_true", help="gpt2-124m on one GPU instead of the CPU scaling runs")
    p.add_argument("--json", help="also write the figures to this file")
    a = p.parse_args()
    a.steps = a.steps or (30 if a.gpu else 40)
    figures = bench_gpu(a) if a.gpu else bench_cpu(a)
    if a.json and figures is not None:
        Path(a.json).write_text(json.dumps(figures, indent=1) + "\n")


if __name__ == "__main__":
    main()

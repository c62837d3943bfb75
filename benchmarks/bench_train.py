"""Training throughput and MFU of the real `ddpgpt train` path: CPU weak scaling W=1 -> W=2, or
one GPU.

    python -m benchmarks.bench_train [--data data/stdlib] [--preset tiny] [--steps 25] \\
        [--json out.json]
    python -m benchmarks.bench_train --gpu  # gpt2-124m, W=1, bf16, --compile; skips without CUDA

CPU mode. Each run is a subprocess `python -m ddpgpt train --device cpu --run.threads 1
--run.eval-every 0 --run.checkpoint-every 0` in a temporary run dir, plain at W=1 and `--nproc 2`
(torch's elastic launcher, gloo) at W=2. The first --warmup rows of its metrics.jsonl are dropped
and the median of the rest is the run's figure; the end-of-run evaluation and checkpoint still
happen, but metrics.paused() keeps them out of tokens_per_s (and --data.eval-windows 16 keeps them
short). W=1 and W=2 runs alternate, --repeats of each, and the report gives medians over runs: the
speed of a shared VM's cores drifts by ±20% over minutes, and alternating cancels slow drift.

Weak scaling holds the work of each process fixed. W=2 trains the preset's global batch G, so each
process runs A = G / (2·b) micro-steps of b sequences per step; W=1 trains G/2, so its one process
runs the same A micro-steps of the same b. Per-process tokens/s should then be the same at W=1 and
W=2, and efficiency = (W=2 total tokens/s) / (2 × W=1 tokens/s) measures what data parallelism
costs: the gradient all-reduce, waiting at each step's sync for the slower rank, and two processes
sharing one machine's caches and memory. It is computed for each W=2 run against the W=1 run just
before it. (Strong scaling, a fixed G, would instead halve A and measure something else.)

MFU = per-process tokens/s × the model's training FLOPs per token (GPT.flops_per_token) / peak.
The peak is measured just before each run: `measure_matmul_flops` (fp32 1024³ matmul, one thread,
as every training process measures it), best of 40 windows of 0.06 s, since one window reads low
whenever something else takes the core. The runs' own `mfu` column (against their single window)
is printed alongside, as is the share of the CPUs other processes took during each run: above a
few percent the run competed for its cores and reads low.

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

from ddpgpt.config.checks import ConfigError
from ddpgpt.config.io import from_dict
from ddpgpt.config.presets import get_preset
from ddpgpt.model.gpt import GPT
from ddpgpt.run.metrics import measure_matmul_flops, peak_flops
from ddpgpt.run.preflight import accum_steps

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
        # Children's CPU time counts the launcher's workers too: they are waited for before it
        # exits.
        own, busy = children_cpu_s() - own0, cpu_busy_s()
        if proc.returncode:
            sys.exit(f"bench_train: `{' '.join(cmd)}` failed (exit {proc.returncode}):\n"
                     f"{proc.stderr[-3000:]}")
        rows = [json.loads(line)
                for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
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
           "accum_steps": accum_steps(cfg, world)}
    if peak is not None:
        flops_per_token = GPT(cfg.model).flops_per_token(cfg.seq_len)
        out["flops_per_token"] = flops_per_token
        out["mfu"] = tps * flops_per_token / peak
    return out


def verdict(value: float, target: float) -> str:
    return f"target >= {target:.0%}: {'met' if value >= target else 'NOT met'}"


def cpu_peak() -> float:
    """One thread's fp32 matmul FLOP/s, as a training process measures it, best of 40 windows."""
    torch.set_num_threads(1)
    return measure_matmul_flops(torch.device("cpu"), windows=40)


def run_line(i: int, r: dict) -> str:
    other = ("" if r["other_cpu_share"] is None
             else f", other processes {r['other_cpu_share']:.0%} of the CPUs")
    return (f"  run {i}: W={r['world_size']} {r['tokens_per_s_per_process']:7,.0f} tokens/s per "
            f"process, MFU {r['mfu']:6.1%} against {r['peak_flops'] / 1e9:.1f} GFLOP/s  "
            f"(mfu column {r['mfu_column']:.1%}{other})")


def bench_cpu(a: argparse.Namespace) -> dict:
    preset = a.preset or "tiny"
    cfg = get_preset(preset)
    try:
        accum_steps(cfg, 2)  # weak scaling needs G divisible by 2·b
    except ConfigError as e:
        sys.exit(f"bench_train: preset {preset}: {e}")
    G = cfg.data.global_batch
    print(f"bench_train: {preset} on CPU, 1 thread per process; W=1 and W=2 alternately, "
          f"{a.repeats} × each, {a.steps} steps per run ({a.warmup} warm-up)", flush=True)
    # W=1 trains G/2 and W=2 trains G: the same A micro-steps of b sequences in every process.
    flags = ["--device", "cpu", "--run.threads", "1"]
    runs = []
    for _ in range(a.repeats):
        for world, global_batch in ((1, G // 2), (2, G)):
            peak = cpu_peak()  # just before the run: this VM's speed drifts over minutes
            run = train(a.data, preset, world, a.steps,
                        [*flags, "--data.global-batch", str(global_batch)])
            runs.append(summarize(run, world, a.warmup, peak) | {"peak_flops": peak})
            print(run_line(len(runs), runs[-1]), flush=True)
    w1, w2 = ([r for r in runs if r["world_size"] == w] for w in (1, 2))
    med = statistics.median
    figures = {"mode": "cpu", "preset": preset, "runs": runs, "mfu_target": MFU_TARGET,
               "efficiency_target": EFFICIENCY_TARGET,
               "peak_flops_per_process": med(r["peak_flops"] for r in runs)}
    for key, rs in (("w1", w1), ("w2", w2)):
        figures[key] = {"tokens_per_s_per_process": med(r["tokens_per_s_per_process"] for r in rs),
                        "mfu": med(r["mfu"] for r in rs), "accum_steps": rs[0]["accum_steps"],
                        "micro_batch": rs[0]["micro_batch"], "global_batch": rs[0]["global_batch"]}
    # Each W=2 run against the W=1 run just before it, so that slow drift cancels.
    figures["efficiency"] = med(r2["tokens_per_s_per_process"] / r1["tokens_per_s_per_process"]
                                for r1, r2 in zip(w1, w2))
    figures["mfu_met"] = min(figures["w1"]["mfu"], figures["w2"]["mfu"]) >= MFU_TARGET
    figures["efficiency_met"] = figures["efficiency"] >= EFFICIENCY_TARGET
    report_cpu(figures, [r["peak_flops"] for r in runs])
    return figures


def report_cpu(f: dict, peaks: list[float]) -> None:
    print(f"medians over the runs:\n  matmul peak {f['peak_flops_per_process'] / 1e9:.1f} GFLOP/s "
          f"per process (fp32 1024³, 1 thread; {min(peaks) / 1e9:.1f} to {max(peaks) / 1e9:.1f} "
          f"over {len(peaks)} measurements)")
    for w in (1, 2):
        r = f[f"w{w}"]
        print(f"  W={w}: {r['tokens_per_s_per_process']:7,.0f} tokens/s per process, "
              f"MFU {r['mfu']:6.1%}   "
              f"(A={r['accum_steps']} × b={r['micro_batch']} per process, G={r['global_batch']})")
    print(f"  weak-scaling efficiency (W=2 total / 2 × W=1): {f['efficiency']:.1%}   "
          f"{verdict(f['efficiency'], EFFICIENCY_TARGET)}")
    print(f"  MFU: W=1 {f['w1']['mfu']:.1%}, W=2 {f['w2']['mfu']:.1%}   "
          f"{verdict(min(f['w1']['mfu'], f['w2']['mfu']), MFU_TARGET)}")


def bench_gpu(a: argparse.Namespace) -> dict | None:
    if not torch.cuda.is_available():
        print("bench_train --gpu: skipped, CUDA is not available")
        return None
    preset = a.preset or "gpt2-124m"
    peak = peak_flops(torch.device("cuda"), torch.bfloat16)  # what the runs' mfu column divides by
    name = torch.cuda.get_device_name()
    print(f"bench_train: {preset}, W=1 on {name}, bf16, compiled; peak {peak / 1e12:.0f} TFLOP/s "
          "(data sheet, or measured if the GPU is not in metrics.GPU_BF16_PEAK)", flush=True)
    run = train(a.data, preset, 1, a.steps,
                ["--device", "cuda", "--run.precision", "bf16", "--compile"])
    r = summarize(run, 1, a.warmup, None)  # the first steps include compilation
    print(f"  {r['tokens_per_s_per_process']:,.0f} tokens/s   MFU {r['mfu_column']:.1%}   "
          f"{verdict(r['mfu_column'], MFU_TARGET)}   "
          f"(A={r['accum_steps']} × b={r['micro_batch']}, median of {r['steps_measured']} steps)")
    return {"mode": "gpu", "preset": preset, "device": name, "peak_flops": peak, "w1": r,
            "mfu_target": MFU_TARGET}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default="data/stdlib")
    p.add_argument("--preset", help="default: tiny on CPU, gpt2-124m with --gpu")
    p.add_argument("--steps", type=int,
                   help="optimizer steps per run (default: 25 on CPU, 30 with --gpu)")
    p.add_argument("--warmup", type=int, default=5,
                   help="first steps of each run left out of the medians")
    p.add_argument("--repeats", type=int, default=2,
                   help="CPU: runs at each of W=1 and W=2, alternating")
    p.add_argument("--gpu", action="store_true",
                   help="gpt2-124m on one GPU instead of the CPU scaling runs")
    p.add_argument("--json", help="also write the figures to this file")
    a = p.parse_args()
    a.steps = a.steps or (30 if a.gpu else 25)
    figures = bench_gpu(a) if a.gpu else bench_cpu(a)
    if a.json and figures is not None:
        Path(a.json).write_text(json.dumps(figures, indent=1) + "\n")


if __name__ == "__main__":
    main()

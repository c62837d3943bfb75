"""`ddpgpt bench`: what each gradient-sync mode costs, on this machine or cluster.

    ddpgpt bench --nproc 2 --data data/stdlib                       # CPU: 2 gloo processes, tiny
    torchrun --standalone --nproc_per_node 8 -m ddpgpt bench --data data/fineweb --preset gpt2-124m
    ddpgpt bench --nproc 2 --sync ddp,zero1 --steps 20 --repeats 3 --out bench/
    ddpgpt bench --device cuda --group --preset gpt2-124m      # one GPU: a one-rank NCCL group

For each mode, with the preset's batch (A micro-steps per step):
- the median step time (forward, backward, sync, clip, update) over `--steps` steps of each of
  `--repeats` rounds (the modes take turns, so a machine's drift does not favour one);
- the exposed communication: that time minus the median of the same steps with no collective
  at all (every rank computing its own micro-batches: the work that no mode can hide);
- the bytes each rank sends per step, computed for ring algorithms from the mode and N (not
  measured: DDP and FSDP2 run their collectives inside torch);
- the memory each rank holds for parameters, gradients and optimizer state (measured from the
  tensors), and on CUDA the activations (peak allocated minus those).

Rank 0 prints a table and writes bench.json and, with matplotlib (`pip install 'ddpgpt[plot]'`),
bench.png.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from ddpgpt import dist, launch
from ddpgpt.config import BenchConfig
from ddpgpt.config_io import build
from ddpgpt.optim import lr_at
from ddpgpt.preflight import preflight
from ddpgpt.reliability import Guard, StopSignal
from ddpgpt.runtime import configure
from ddpgpt.train import Trainer


def sent_bytes(mode: str, params: int, world: int, accum: int, compress: bool) -> int:
    """Bytes one rank sends per optimizer step in ring collectives (each moves (W-1)/W of its
    tensor per pass): an all-reduce is a reduce-scatter plus an all-gather, two passes."""
    fraction = (world - 1) / world
    grads, weights = params * (2 if compress else 4), params * 4
    passes = {"ddp": 2 * grads, "allreduce": 2 * grads, "rs-ag": 2 * grads,
              "zero1": grads + weights,  # gradients reduce-scattered, parameters all-gathered
              # each micro-step all-gathers the parameters for its forward and again for its
              # backward; the last one reduce-scatters the gradients
              "fsdp2": 2 * accum * weights + grads}
    return int(fraction * passes[mode])


def time_steps(trainer: Trainer, warmup: int, steps: int) -> tuple[list[float], dict]:
    """Step times after `warmup` steps, and the memory held at the last step's fullest moment:
    after its gradients are synced, before the update (which may free them)."""
    cfg, times = trainer.cfg, []
    for k in range(warmup + steps):
        dist.barrier(trainer.env)  # every rank starts the step together
        start = time.perf_counter()
        trainer.train_step()
        if k == warmup + steps - 1:
            counted = time.perf_counter()
            held = trainer.sync.memory()
            start += time.perf_counter() - counted  # not part of the step
        trainer.update(lr_at(k, cfg.optim, warmup + steps))
        if trainer.env.device.type == "cuda":
            torch.cuda.synchronize()
        if k >= warmup:
            times.append(time.perf_counter() - start)
    return times, held


def measure(cfg: BenchConfig, env: dist.DistEnv, mode: str | None, run_dir: str) -> dict:
    """One mode (None: no collective at all) on a fresh trainer: its step times."""
    flags = {"data": {"dir": cfg.data, "verify": False},
             "run": {"dir": run_dir, "device": env.device.type, "sync": mode or "ddp"}}
    train_cfg, dataset = preflight(build(cfg.preset, cfg.config, flags), env.world_size,
                                   env.local_world_size)
    configure(train_cfg.run.threads, env.device)
    guard = Guard(env, train_cfg.run, StopSignal(announce=False))
    trainer = Trainer(train_cfg, env, dataset, guard)
    n = sum(p.numel() for p in trainer.raw.parameters())
    if mode is not None:
        trainer.wrap()
    if env.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(env.device)
    times, held = time_steps(trainer, cfg.warmup, cfg.steps)
    if env.device.type == "cuda":
        held["activations"] = torch.cuda.max_memory_allocated(env.device) - sum(held.values())
    runs_as = type(trainer.sync).__name__  # Sync: no collective at all
    trainer.unwrap()
    return {"mode": mode or "no sync", "runs_as": runs_as, "times": times,
            "sent_bytes": sent_bytes(mode, n, env.world_size, trainer.accum, False) if mode else 0,
            "memory": held, "accum": trainer.accum, "params": n}


def run(cfg: BenchConfig) -> None:
    if cfg.nproc:
        launch.check_nproc(cfg.nproc, cfg.device)
        args = ["bench"]
        for key, value in vars(cfg).items():
            flag = key.replace("_", "-")
            if isinstance(value, bool):
                args.append(f"--{flag}" if value else f"--no-{flag}")
            elif key != "nproc" and value is not None:
                args.append(f"--{flag}={value}")
        sys.exit(launch.start(cfg.nproc, args)[0])
    with dist.session(cfg.device, group_at_one=cfg.group) as env, \
            tempfile.TemporaryDirectory() as run_dir:
        modes = [None, *cfg.sync.split(",")]
        rounds = [[measure(cfg, env, mode, run_dir) for mode in modes]
                  for _ in range(cfg.repeats)]
        rows = rounds[-1]
        for i, row in enumerate(rows):
            row["step_s"] = statistics.median(t for r in rounds for t in r[i]["times"])
        for row in rows:
            del row["times"]
        # A step is as slow as its slowest rank: report the maximum over ranks.
        slowest = dist.all_reduce(env, torch.tensor([r["step_s"] for r in rows]), op="max")
        for row, step_s in zip(rows, slowest.tolist()):
            row["step_s"], row["exposed_s"] = step_s, max(0.0, step_s - slowest[0].item())
        if env.is_main:
            report(cfg, env, rows)


def report(cfg: BenchConfig, env: dist.DistEnv, rows: list[dict]) -> None:
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    where = {"world_size": env.world_size, "device": env.device.type, "backend": env.backend,
             "preset": cfg.preset, "config": cfg.config, "torch": torch.__version__,
             "steps": cfg.steps, "repeats": cfg.repeats}
    (out / "bench.json").write_text(json.dumps({**where, "rows": rows}, indent=1) + "\n")
    mb = 2**20
    print(f"ddpgpt bench: {env.world_size} process{'es' if env.world_size > 1 else ''}, "
          f"{env.device.type} ({env.backend or 'no group'}), preset {cfg.preset}, "
          f"A={rows[0]['accum']}, {rows[0]['params'] / 1e6:.2f}M parameters; medians of "
          f"{cfg.steps * cfg.repeats} steps" + (f" in {cfg.repeats} rounds" if cfg.repeats > 1
                                                else ""))
    print(f"{'mode':10s} {'step ms':>9s} {'exposed ms':>11s} {'sent MB/step':>13s} "
          f"{'params MB':>10s} {'grads MB':>9s} {'state MB':>9s}")
    for r in rows:
        m = r["memory"]
        print(f"{r['mode']:10s} {r['step_s'] * 1e3:9.1f} {r['exposed_s'] * 1e3:11.1f} "
              f"{r['sent_bytes'] / mb:13.2f} {m['params'] / mb:10.2f} {m['grads'] / mb:9.2f} "
              f"{m['state'] / mb:9.2f}")
    png = plot(rows, out / "bench.png", f"W={env.world_size}, {env.device.type}, {cfg.preset}")
    print(f"wrote {out / 'bench.json'}" + (f" and {png}" if png else
                                           " (no chart: pip install 'ddpgpt[plot]' for bench.png)"))


def plot(rows: list[dict], path: Path, title: str) -> Path | None:
    """Step time (compute and exposed communication) and memory per rank, per mode; None
    without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = [r["mode"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    compute = [(r["step_s"] - r["exposed_s"]) * 1e3 for r in rows]
    left.bar(modes, compute, label="compute")
    left.bar(modes, [r["exposed_s"] * 1e3 for r in rows], bottom=compute,
             label="exposed communication")
    left.set_ylabel("ms per step (slowest rank)")
    left.legend()
    bottom = [0.0] * len(rows)
    for part in ("params", "grads", "state", "activations"):
        values = [r["memory"].get(part, 0) / 2**20 for r in rows]
        if any(values):
            right.bar(modes, values, bottom=bottom, label=part)
            bottom = [b + v for b, v in zip(bottom, values)]
    right.set_ylabel("MB per rank")
    right.legend()
    for axis in (left, right):
        axis.tick_params(axis="x", rotation=30)
    fig.suptitle(f"ddpgpt bench: {title}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

"""What a checkpoint costs each rank: peak host memory during a save, the time the step is
blocked by it, and the time to resume, for the sharded store (asynchronous, and not) against the
previous one (every rank's state gathered to rank 0, serialized there in memory and written).

    python -m benchmarks.bench_checkpoint --data data/stdlib [--preset small] [--worlds 1 2 4] \\
        [--modes ddp zero1 fsdp2] [--json out.json]
    python -m benchmarks.bench_checkpoint --data data/stdlib --preset gpt2-124m --worlds 1 \\
        --device cuda   # on a GPU

Each W runs as W processes (gloo on CPU, one thread each), like `--nproc W`. Per sync mode every
rank builds the preset's model and takes one optimizer step (AdamW: weights and both moments
exist; a batch of one 64-token sequence per rank, since only the state's size matters here),
then, one after the other:

- previous: Trainer.state_dict() (zero1 and fsdp2 gather the moments, fsdp2 the weights too),
  then rank 0 serializes it in memory (safetensors + torch.save), writes and fsyncs it, as the
  store before format 3 did; the other ranks wait.
- sync: the sharded save with run.checkpoint_async off: each rank writes its share in the step.
- async: the sharded save: the step waits while the rank copies its share to CPU memory; the
  write goes on in the background. Measured alone, then again with 3 training steps running
  during the write: their time against 3 without a save is what the background write costs
  the steps on a machine whose cores train too.

Memory: the rise of the process's peak resident set (VmHWM, reset through /proc/self/clear_refs
before each save) over its resident set before it, until the save is published. glibc's malloc
runs with a fixed mmap threshold (MALLOC_MMAP_THRESHOLD_ = 128 KiB), so that every large buffer
is returned to the system when freed and one save's memory does not hide in the next one's.
Resume: every rank checks the checkpoint's files (sha256, as a training's start does) and loads
it into its trainer: format 3 in place, each rank its chunks; the previous format whole on every
rank.
Times are medians over --repeats; all ranks agree on when each save starts (a barrier).

Then the same on paper for gpt2-124m, 1.3B and 7B at W=8 (`project`; `--project-only` prints it
alone, from the ratios measured on the small preset unless --json's results are given): the
state is fp32 weights and AdamW's two moments, 12 bytes a parameter. Rank 0's peak under the
previous store is the state times the ratio this benchmark measured (the gathered state plus its
serialized copy); a rank's under the sharded store is its share, 1/W of the state, staged for the
background write. The step's stall is that copy from the GPU at PCIE_BYTES_S (pinned host memory,
PCIe 5 x16 as measured in practice, not its 64 GB/s peak); the previous store's, the gather
(NVLink, negligible), serializing at MEMCPY_BYTES_S and writing at DISK_BYTES_S, all by rank 0
while every rank waits. The sharded write in the step is bound by the node's disk too: 8 ranks
share it.
"""

from __future__ import annotations

import argparse
import functools
import io
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# On paper (`project`): parameters of each model (GPT-2's vocabulary, 1024 positions), the bytes
# of state per parameter, and the rates of a GPU node.
PROJECTED = {"gpt2-124m": dict(n_layer=12, n_head=12, n_embd=768),
             "1.3B": dict(n_layer=24, n_head=16, n_embd=2048),
             "7B": dict(n_layer=32, n_head=32, n_embd=4096)}
STATE_BYTES = 12               # fp32 weights + AdamW's exp_avg and exp_avg_sq
PCIE_BYTES_S = 25e9            # device to pinned host memory, per GPU
MEMCPY_BYTES_S = 5e9           # serializing in memory, one thread
DISK_BYTES_S = 2e9             # one node's local NVMe
MEASURED_RATIO = (1.65, 2.67)  # rank 0's peak / the state, previous store (small preset, CPU)


def peak_kb() -> int:
    return int(re.search(r"VmHWM:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))


def rss_kb() -> int:
    return int(re.search(r"VmRSS:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))


def reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")


def previous_save(trainer, root: Path, step: int) -> None:
    """The store before format 3: the whole state gathered (collective), rank 0 serializes it
    in memory and writes it, fsynced, meta.json last, renamed; every rank waits for rank 0."""
    import hashlib

    import torch
    from safetensors.torch import save as save_safetensors

    from ddpgpt.distributed import collectives
    from ddpgpt.files import fsync, write_bytes

    state = trainer.state_dict()
    if trainer.env.is_main:
        buffer = io.BytesIO()
        torch.save({k: v for k, v in state.items() if k != "model"}, buffer)
        files = {"model.safetensors": save_safetensors(
            {k: v.detach().to("cpu", copy=True) for k, v in state["model"].items()}),
                 "trainer.pt": buffer.getvalue()}
        tmp, final = root / f".tmp-step_{step:07d}", root / f"step_{step:07d}"
        tmp.mkdir(parents=True)
        for name, data in files.items():
            write_bytes(tmp / name, data)
        meta = {"format_version": 2, "step": step, "world_size": trainer.env.world_size,
                "files": {n: hashlib.sha256(d).hexdigest() for n, d in files.items()}}
        write_bytes(tmp / "meta.json", json.dumps(meta).encode())
        fsync(tmp)
        os.rename(tmp, final)
        fsync(root)
        del files, buffer
    del state
    collectives.barrier(trainer.env)


def train_steps(t, n: int) -> float:
    """Seconds of `n` training steps (every rank; a barrier at the end)."""
    from ddpgpt.distributed import collectives
    from ddpgpt.optim.schedule import Schedule

    start = time.perf_counter()
    for _ in range(n):
        t.train_step()
        t.update(Schedule(t.cfg.optim, 10).at(0))
    collectives.barrier(t.env)
    return time.perf_counter() - start


def measure(t, env, root: Path, group, method: str, step: int, steps) -> dict:
    """One save of `t` by `method`: its peak memory, the time the caller was blocked and until
    the checkpoint was published (nothing else running); for async, also what the background
    write costs 3 training steps that run during it (a second save)."""
    from ddpgpt.checkpoint.saver import Saver
    from ddpgpt.distributed import collectives

    def save(at: int, during: int) -> tuple[float, float, float]:
        saver = Saver(env, root, group, "bench", keep=100, asynchronous=method == "async")
        collectives.barrier(env)
        start = time.perf_counter()
        if method == "previous":
            previous_save(t, root, at)
        else:
            held, replicated, rest = t.shard_state()
            saver.save(at, held, replicated, rest, {}, wait=False)
        blocked = time.perf_counter() - start
        stepped = steps(during) if during else 0.0
        saver.settle()
        total = time.perf_counter() - start
        saver.close()
        collectives.barrier(env)
        return blocked, total, stepped

    base = rss_kb()
    reset_peak()
    blocked, total, _ = save(step, 0)
    out = {"blocked_s": blocked, "total_s": total, "peak_mb": (peak_kb() - base) / 1024,
           "steps_extra_s": 0.0}
    if method == "async":
        quiet = steps(3)
        out["steps_extra_s"] = save(step + 50, 3)[2] - quiet
    return out


def worker(args) -> None:
    """One rank: every mode, every method; rank 0 writes the results."""
    import torch

    from ddpgpt.checkpoint import sharded, store
    from ddpgpt.config.io import build
    from ddpgpt.distributed import collectives
    from ddpgpt.distributed.group import checkpoint_group, session
    from ddpgpt.guard.health import Guard, StopSignal
    from ddpgpt.run.preflight import preflight
    from ddpgpt.trainer import Trainer

    results = {}
    with session(device=args.device) as env:
        torch.set_num_threads(1)
        group = checkpoint_group(env)
        root = Path(collectives.all_gather_text(env, tempfile.mkdtemp(dir=args.tmp))[0])
        for mode in args.modes:
            flags = {"data": {"dir": args.data, "micro_batch": 1, "global_batch": env.world_size,
                              "seq_len": 64, "eval_windows": 1},
                     "run": {"dir": str(root), "sync": mode, "device": args.device, "threads": 1,
                             "precision": "fp32"},
                     "optim": {"name": "adamw"}}
            cfg, dataset = preflight(build(args.preset, None, flags), env.world_size,
                                     env.local_world_size)
            t = Trainer(cfg, env, dataset, Guard(env, cfg.run, StopSignal(announce=False)))

            steps = functools.partial(train_steps, t)
            steps(1)  # the optimizer's state exists from here on
            row = {"share_bytes": sum(p.nbytes for p in sharded.share(
                *t.sync.checkpoint_state(t.optimizer), env.rank, env.world_size).values())}
            for method in ("previous", "sync", "async"):
                runs = []
                for r in range(args.repeats):
                    step = 100 * (1 + ["previous", "sync", "async"].index(method)) + r
                    runs.append(measure(t, env, root, group, method, step, steps))
                row[method] = {k: statistics.median(x[k] for x in runs) for k in runs[0]}
            for method, step in (("previous", 100), ("sync", 200)):
                path = root / f"step_{step:07d}"
                times, peaks = [], []
                for _ in range(args.repeats):
                    collectives.barrier(env)
                    base = rss_kb()
                    reset_peak()
                    start = time.perf_counter()
                    meta = store.read_meta(path, verify=True)
                    t.restore(path, meta)
                    collectives.barrier(env)
                    times.append(time.perf_counter() - start)
                    peaks.append((peak_kb() - base) / 1024)
                row[f"resume_{method}"] = {"s": statistics.median(times),
                                           "peak_mb": statistics.median(peaks)}
            results[mode] = collectives.all_gather_text(env, json.dumps(row))
            t.close()
            for p in list(root.iterdir()):
                if env.is_main:
                    shutil.rmtree(p, ignore_errors=True)
            collectives.barrier(env)
        if env.is_main:
            Path(args.out).write_text(json.dumps(results))


def run(world: int, args) -> dict:
    """W processes started as torchrun starts them; their results."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = Path(args.tmp) / f"w{world}.json"
    argv = [sys.executable, "-m", "benchmarks.bench_checkpoint", "--worker", "--out", str(out),
            "--data", args.data, "--preset", args.preset, "--device", args.device,
            "--tmp", args.tmp, "--repeats", str(args.repeats), "--modes", *args.modes]
    procs = [subprocess.Popen(argv, cwd=REPO, env={
        **os.environ, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
        "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": str(128 * 1024)})
        for r in range(world)]
    codes = [p.wait() for p in procs]
    if any(codes):
        raise SystemExit(f"W={world}: ranks exited {codes}")
    return {mode: [json.loads(r) for r in ranks]
            for mode, ranks in json.loads(out.read_text()).items()}


def report(results: dict) -> None:
    """Two tables, the worst rank of each W and mode (rank 0 for the previous store's save)."""
    def worst(ranks, method, key):
        return max(r[method][key] for r in ranks)

    print("| W | mode | written per rank (MB) | peak memory per rank during a save (MB): "
          "previous / sync / async | resume: peak memory per rank (MB), previous / sharded |")
    print("|---:|---|---:|---|---|")
    for world, modes in results.items():
        for mode, ranks in modes.items():
            share = max(r["share_bytes"] for r in ranks) / 2**20
            print(f"| {world} | {mode} | {share:.0f} | "
                  + " / ".join(f"{worst(ranks, m, 'peak_mb'):.0f}"
                               for m in ("previous", "sync", "async"))
                  + f" | {worst(ranks, 'resume_previous', 'peak_mb'):.0f} / "
                  f"{worst(ranks, 'resume_sync', 'peak_mb'):.0f} |")
    print()
    print("| W | mode | step blocked (s): previous / sync / async | published after (s): "
          "previous / sync / async | async: 3 steps during the write slower by (s) | "
          "resume (s): previous / sharded |")
    print("|---:|---|---|---|---:|---|")
    for world, modes in results.items():
        for mode, ranks in modes.items():
            print(f"| {world} | {mode} | "
                  + " / ".join(f"{worst(ranks, m, 'blocked_s'):.3f}"
                               for m in ("previous", "sync", "async")) + " | "
                  + " / ".join(f"{worst(ranks, m, 'total_s'):.2f}"
                               for m in ("previous", "sync", "async"))
                  + f" | {worst(ranks, 'async', 'steps_extra_s'):.2f} | "
                  f"{worst(ranks, 'resume_previous', 's'):.2f} / "
                  f"{worst(ranks, 'resume_sync', 's'):.2f} |")


def state_ratio(results: dict) -> tuple[float, float]:
    """Rank 0's peak during the previous store's save over the whole state, least and most."""
    ratios = [ranks[0]["previous"]["peak_mb"] / (sum(r["share_bytes"] for r in ranks) / 2**20)
              for modes in results.values() for ranks in modes.values()]
    return min(ratios), max(ratios)


def project(world: int = 8, ratio: tuple[float, float] = MEASURED_RATIO) -> list[dict]:
    """Per model at `world` ranks: the state, the host memory and the step's stall of a save,
    previous store against sharded (GB, s)."""
    import torch

    from ddpgpt.config.model import ModelConfig
    from ddpgpt.model.gpt import GPT

    rows = []
    for name, shape in PROJECTED.items():
        with torch.device("meta"):
            n = GPT(ModelConfig(block_size=1024, vocab_size=50304, **shape)).num_params(
                non_embedding=False)
        state = STATE_BYTES * n
        share = state / world
        rows.append({"model": name, "params": n, "state_gb": state / 1e9,
                     "previous_gb": (ratio[0] * state / 1e9, ratio[1] * state / 1e9),
                     "sharded_gb": share / 1e9,
                     "previous_s": state / MEMCPY_BYTES_S + state / DISK_BYTES_S,
                     "in_step_s": state / DISK_BYTES_S,
                     "async_s": share / PCIE_BYTES_S})
    return rows


def print_projection(rows: list[dict], world: int) -> None:
    print(f"\nOn paper, W={world} on one node (state: {STATE_BYTES} bytes a parameter; "
          f"{PCIE_BYTES_S / 1e9:.0f} GB/s device to host, {MEMCPY_BYTES_S / 1e9:.0f} GB/s "
          f"serializing, {DISK_BYTES_S / 1e9:.0f} GB/s disk):")
    print("| model | state (GB) | host memory during a save: previous, rank 0 / sharded, per "
          "rank (GB) | the step blocked: previous / sharded in the step / background (s) |")
    print("|---|---:|---|---|")
    for r in rows:
        low, high = r["previous_gb"]
        print(f"| {r['model']} ({r['params'] / 1e9:.2f}B) | {r['state_gb']:.1f} | {low:.0f}–"
              f"{high:.0f} / {r['sharded_gb']:.1f} | {r['previous_s']:.0f} / "
              f"{r['in_step_s']:.0f} / {r['async_s']:.2f} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default="data/stdlib")
    p.add_argument("--preset", default="small")
    p.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--modes", nargs="+", default=["ddp", "zero1", "fsdp2"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default="")
    p.add_argument("--tmp", default="")
    p.add_argument("--project-only", action="store_true",
                   help="print the projection to larger models alone (from --json if it exists)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    if args.project_only:
        saved = Path(args.json) if args.json else None
        ratio = state_ratio(json.loads(saved.read_text())) if saved and saved.exists() \
            else MEASURED_RATIO
        print_projection(project(8, ratio), 8)
        return
    with tempfile.TemporaryDirectory(dir=args.tmp or None) as tmp:
        args.tmp = tmp
        results = {w: run(w, args) for w in args.worlds}
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    report(results)
    print_projection(project(8, state_ratio(results)), 8)


def report_file(path: str) -> None:
    """The tables again from a --json file: python -c 'from benchmarks.bench_checkpoint import
    report_file; report_file("out.json")'."""
    report(json.loads(Path(path).read_text()))


if __name__ == "__main__":
    main()

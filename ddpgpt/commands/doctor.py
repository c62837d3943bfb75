"""`ddpgpt doctor`: what this machine offers, and how fast its ranks can all-reduce.

    ddpgpt doctor                      # environment report
    ddpgpt doctor --nproc 2            # plus an all-reduce probe over 2 local processes
    torchrun --nproc_per_node 8 -m ddpgpt doctor --probe-mb 256

The probe times an all-reduce of `probe_mb` MB of float32 and reports its bus bandwidth,
2·(n−1)/n · bytes / time: the traffic each rank's link carries in a ring all-reduce, comparable
across world sizes (the convention of nccl-tests).
"""

from __future__ import annotations

import os
import platform
import sys
import time

import torch
import torch.distributed as tdist

from ddpgpt import __version__
from ddpgpt.config.commands import DoctorConfig
from ddpgpt.distributed import collectives
from ddpgpt.distributed.group import DistEnv, session
from ddpgpt.run import launch


def report() -> list[str]:
    lines = [f"ddpgpt {__version__}, python {platform.python_version()}, torch {torch.__version__}",
             f"cpu: {len(os.sched_getaffinity(0))} usable cores, torch threads "
             f"{torch.get_num_threads()}"]
    if torch.cuda.is_available():
        lines.append(f"cuda {torch.version.cuda}: {torch.cuda.device_count()} device(s)")
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            lines.append(f"  cuda:{i} {p.name}, {p.total_memory / 2**30:.0f} GiB, "
                         f"bf16 {'yes' if torch.cuda.is_bf16_supported() else 'no'}")
    else:
        lines.append("cuda: not available (training runs on CPU with gloo)")
    backends = [name for name, ok in (("gloo", tdist.is_gloo_available()),
                                      ("nccl", tdist.is_nccl_available()),
                                      ("mpi", tdist.is_mpi_available())) if ok]
    lines.append(f"torch.distributed: {'available' if tdist.is_available() else 'missing'}; "
                 f"backends {', '.join(backends) or 'none'}")
    return lines


def probe(env: DistEnv, megabytes: float, iters: int = 5) -> tuple[float, float]:
    """(seconds per all-reduce, bus bandwidth in bytes/s) for `megabytes` of float32."""
    numel = int(megabytes * 2**20 / 4)
    x = torch.ones(numel, device=env.device)
    collectives.all_reduce(env, x)  # warm up: connections, buffers
    collectives.barrier(env)
    start = time.perf_counter()
    for _ in range(iters):
        collectives.all_reduce(env, x)
    if env.device.type == "cuda":
        torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / iters
    n = env.world_size
    return seconds, 2 * (n - 1) / n * numel * 4 / seconds


def run(cfg: DoctorConfig) -> None:
    if cfg.nproc:
        launch.check_nproc(cfg.nproc, "auto")
        for line in report():
            print(line, flush=True)
        sys.exit(launch.start(cfg.nproc, ["doctor", "--probe-mb", str(cfg.probe_mb)])[0])
    with session() as env:
        if env.world_size == 1:
            for line in report():
                print(line)
            print("all-reduce probe: one process; run `ddpgpt doctor --nproc N` or under "
                  "torchrun to measure it")
            return
        seconds, busbw = probe(env, cfg.probe_mb)
        if env.is_main:
            print(f"all-reduce {cfg.probe_mb:g} MB over {env.world_size} processes "
                  f"({env.backend}, {env.device.type}): "
                  f"{seconds * 1e3:.1f} ms, bus bandwidth {busbw / 1e9:.2f} GB/s")

"""Datasets and checkpoints in object storage against a local disk, with a local S3 server
(moto's standalone server, the one the tests start: tests/s3.py):

    python -m benchmarks.bench_storage [--tokens 8e6] [--steps 20] [--json out.json]

1. The loader, one rank's view at W=1 and W=2 (rank 0 of W: it reads its 1/W of each step's
   windows): tokens per second per rank over `--steps` steps of G=64 windows of T=1024, read
   as fast as it can (no model: the loader alone), from the local disk, from S3 without a cache,
   and from S3 with data.cache warm (a second pass over the same steps: a later epoch or a
   restart on the node). And the step's stall: the same steps with 0.2 s of "compute" between
   them (what a step waits for its windows, which the fetch ahead hides).
2. A checkpoint of the `small`-shaped model's weights (one process): store.save and read.load to
   a local directory and to S3 (seconds, medians of --repeats).

The server is a Python process on this machine: its figures are an upper bound on what the
client costs and a lower bound on a real store's bandwidth, not a cloud's latency.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from ddpgpt.checkpoint import location, read, store
from ddpgpt.config.model import ModelConfig
from ddpgpt.data.loader import TrainLoader
from ddpgpt.data.shards import TokenDataset
from ddpgpt.model.gpt import GPT
from tests.helpers import write_dataset
from tests.s3 import S3Server

T, B, G = 1024, 8, 64


def loader_rate(ds, world: int, steps: int, cache: str = "", compute_s: float = 0.0,
                passes: int = 1) -> tuple[float, float]:
    """(tokens/s of rank 0 of `world`, the median seconds a step waited for its windows) over
    the last of `passes` passes."""
    for _ in range(passes):
        loader = TrainLoader(ds, seq_len=T, micro_batch=B, world_size=world, rank=0,
                             accum_steps=G // (B * world), seed=1, cache=cache)
        waits, start = [], time.perf_counter()
        for _ in range(steps):
            t = time.perf_counter()
            for _ in loader.next_step():
                pass
            waits.append(time.perf_counter() - t)
            if compute_s:
                time.sleep(compute_s)
        seconds = time.perf_counter() - start - compute_s * steps
    return steps * G // world * (T + 1) / seconds, statistics.median(waits)


def checkpoint_times(root, repeats: int) -> tuple[float, float]:
    model = GPT(ModelConfig(n_layer=6, n_head=6, n_embd=384, block_size=256, vocab_size=4096))
    state = {"model": model.state_dict(), "optimizer": {"step": 1}}
    saves, loads = [], []
    for i in range(repeats):
        t = time.perf_counter()
        path = store.save(root, i + 1, state, {"config": {}}, keep=1)
        saves.append(time.perf_counter() - t)
        t = time.perf_counter()
        read.load(path, store.read_meta(path), weights_only=True)
        loads.append(time.perf_counter() - t)
    return statistics.median(saves), statistics.median(loads)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=float, default=8e6)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    a = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-storage-"))
    rng = np.random.default_rng(0)
    n = int(a.tokens)
    local = write_dataset(work / "data", rng.integers(1, 50000, n, dtype=np.uint16),
                          rng.integers(1, 50000, n // 100, dtype=np.uint16), 50257,
                          shard_tokens=n // 4, kind="gpt2")
    server = S3Server.start(work)
    import os
    os.environ.update(server.env())
    try:
        url = server.bucket("bench") + "/data"
        fs = server.fs()
        for path in sorted(local.iterdir(), key=lambda p: p.name == "meta.json"):
            fs.put_file(str(path), f"{url[5:]}/{path.name}")
        datasets = {"local disk": TokenDataset(local), "S3": TokenDataset(url)}
        rows = []
        for world in (1, 2):
            for name, ds in datasets.items():
                caches = [("", 1)] + ([(str(work / f"cache{world}"), 2)] if name == "S3" else [])
                for cache, passes in caches:
                    rate, _ = loader_rate(ds, world, a.steps, cache, passes=passes)
                    _, wait = loader_rate(ds, world, a.steps, cache, compute_s=0.2,
                                          passes=passes)
                    label = name + (" + cache (warm)" if cache else "")
                    rows.append({"W": world, "source": label, "tokens_per_s": rate,
                                 "wait_s": wait})
                    print(f"loader W={world} rank 0, {label}: {rate / 1e6:.2f}M tokens/s, "
                          f"a step with 0.2 s of compute waits {wait * 1e3:.1f} ms (median)",
                          flush=True)
        ckpt = {}
        for name, root in (("local disk", work / "checkpoints"),
                           ("S3", location.at(server.bucket("ckpt") + "/run"))):
            save_s, load_s = checkpoint_times(root, a.repeats)
            ckpt[name] = {"save_s": save_s, "load_s": load_s}
            print(f"checkpoint (10.6M parameters, 42 MB) to {name}: save {save_s:.2f} s, "
                  f"restore {load_s:.2f} s", flush=True)
        if a.json:
            a.json.write_text(json.dumps({"loader": rows, "checkpoint": ckpt}, indent=1))
    finally:
        server.stop()


if __name__ == "__main__":
    main()

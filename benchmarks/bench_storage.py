"""Datasets and checkpoints in object storage at a cloud's latency: a local S3 server (moto's
standalone server, the one the tests start: tests/s3.py) behind a shaper (tests/shaper.py) that
holds every request `--delay` seconds and caps each connection at `--rate` bytes/s.

    python -m benchmarks.bench_storage [--delay 0.03,0.1] [--rate 50e6] [--step 0.1,0.5] \\
        [--worlds 1,4] [--steps 40] [--windows 8] [--params 41e6] [--json out.json]

1. The loader, first epoch, for each delay, step time (a sleep standing for the GPU's compute),
   W and data.cache off/on (a new, empty cache): W ranks of one node as W loaders in threads of
   this process, each reading its 1/W of every step's G windows of T tokens and meeting the
   others at the end of each step (as the gradients' all-reduce makes them). Rank 0's data wait
   per step (the time its reads of the step took), its mean over the steps after the first (the
   first waits for a fetch whatever is done: it is reported apart), that mean as a share of the
   step, and the tokens per second the rank was given (its tokens over the step plus its wait).
2. A checkpoint of the weights and AdamW's two moments of GPT-2 124M's tensors (`--params
   124e6`: 1.49 GB with the moments; the default, 41e6, keeps the embeddings and no layer,
   473 MB, which this 2-core machine moves in about a minute), for each delay: saved
   by the training's Saver in the background (the step's stall, `blocked_s`; the upload's time),
   then restored on an empty node (a new client, nothing local: find the newest checkpoint,
   verify it, load every tensor) against a plain download of the same objects (s3fs's get).

The server is a Python process sharing this machine's cores with the shaper and the clients:
it answers ~150-250 ranged GETs a second, which is why G is small (8 windows of 1024 tokens: 80
GETs a second at 0.1 s a step); a real store's ceiling is far above that (S3: 5,500 GETs a
second per prefix), and what this measures is whether the latency is hidden, not the ceiling.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

from ddpgpt.data.loader import TrainLoader
from ddpgpt.data.shards import TokenDataset
from tests.helpers import write_dataset
from tests.s3 import S3Server
from tests.shaper import Shaper

T, G = 1024, 8


def floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def point_at(endpoint: str) -> None:
    """This process's S3 clients at `endpoint` from now on (fsspec's cached ones dropped)."""
    import s3fs

    os.environ["AWS_ENDPOINT_URL"] = endpoint
    s3fs.S3FileSystem.clear_instance_cache()


def loader_run(url: str, world: int, step_s: float, steps: int, cache: str, G: int = G) -> dict:
    """Rank 0's waits over `steps` steps of `world` ranks (threads) with `step_s` of compute,
    G windows a step."""
    ds = TokenDataset(url)
    loaders = [TrainLoader(ds, seq_len=T, micro_batch=G // world, world_size=world, rank=r,
                           seed=7, cache=cache) for r in range(world)]
    barrier, waits = threading.Barrier(world), [[] for _ in range(world)]

    def rank(r: int) -> None:
        for _ in range(steps):
            start = time.perf_counter()
            for _ in loaders[r].next_step():
                pass
            waits[r].append(time.perf_counter() - start)
            time.sleep(step_s)
            barrier.wait()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    mine, later = waits[0], waits[0][1:]
    mean = statistics.fmean(later)
    ahead = loaders[0].ahead  # the distance the last step asked for, its own step included
    fetched = sum(lo.stream.reader.fetched_bytes for lo in loaders)
    for lo in loaders:
        lo.stream.reader.close()
    return {"first_wait_s": mine[0], "wait_s": mean, "wait_pct": 100 * mean / step_s,
            "median_wait_s": statistics.median(later), "max_wait_s": max(later),
            "tokens_per_s": G // world * T / (step_s + mean),
            "ahead_steps": ahead, "fetched_mb": fetched / 1e6,
            "waits_ms": [round(w * 1e3, 1) for w in mine]}


def state_of(params: float) -> dict[str, torch.Tensor]:
    """GPT-2 124M's fp32 tensors (vocabulary 50304, 768 wide, T=1024), as many layers as fit in
    `params`, and AdamW's two moments of each: 12 bytes a parameter."""
    n, d = 12, 768
    layer = {"attn.c_attn.weight": (3 * d, d), "attn.c_attn.bias": (3 * d,),
             "attn.c_proj.weight": (d, d), "attn.c_proj.bias": (d,), "ln_1.weight": (d,),
             "ln_1.bias": (d,), "ln_2.weight": (d,), "ln_2.bias": (d,),
             "mlp.c_fc.weight": (4 * d, d), "mlp.c_fc.bias": (4 * d,),
             "mlp.c_proj.weight": (d, 4 * d), "mlp.c_proj.bias": (d,)}
    shapes = {"wte.weight": (50304, d), "wpe.weight": (1024, d), "ln_f.weight": (d,),
              "ln_f.bias": (d,)}
    per_layer = sum(int(np.prod(s)) for s in layer.values())
    base = sum(int(np.prod(s)) for s in shapes.values())
    for i in range(max(0, min(n, int((params - base) // per_layer)))):
        shapes.update({f"h.{i}.{k}": s for k, s in layer.items()})
    g = torch.Generator().manual_seed(0)
    state = {}
    for name, shape in shapes.items():
        w = torch.randn(shape, generator=g)
        state[f"model.{name}"] = w
        state[f"optimizer.adamw.{name}.exp_avg"] = w * 0.1
        state[f"optimizer.adamw.{name}.exp_avg_sq"] = w * w
    return state


def checkpoint_run(root: str, state: dict[str, torch.Tensor], step: int) -> dict:
    """A background save of `state` at `root` (a URL), then a restore on an empty node."""
    import s3fs

    from ddpgpt.checkpoint import read, sharded, store
    from ddpgpt.checkpoint.saver import Saver
    from ddpgpt.distributed.group import DistEnv

    held = {k: sharded.whole(v) for k, v in state.items()}
    saver = Saver(DistEnv(), root, None, "bench", keep=1)
    start = time.perf_counter()
    saver.save(step, held, set(held), {"optimizer": {"step": step}}, {"config": {}})
    blocked = time.perf_counter() - start
    saver.settle()
    upload = time.perf_counter() - start
    saver.close()
    s3fs.S3FileSystem.clear_instance_cache()  # an empty node: a new client, nothing local
    start = time.perf_counter()
    path, meta = store.find_latest(root)
    got = read.load(path, meta)
    restore = time.perf_counter() - start
    assert all(torch.equal(got["model"][k[6:]], v) for k, v in state.items()
               if k.startswith("model."))
    s3fs.S3FileSystem.clear_instance_cache()
    fs = s3fs.S3FileSystem()
    keys = [k for k in fs.find(f"{root[5:]}/step_{step:07d}")]
    with tempfile.TemporaryDirectory() as out:
        start = time.perf_counter()
        fs.get(keys, out + "/")
        download = time.perf_counter() - start
    size = sum(fs.size(k) for k in keys)
    return {"bytes": size, "blocked_s": blocked, "upload_s": upload, "restore_s": restore,
            "download_s": download, "restore_over_download": restore / download}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--delay", type=floats, default=[0.03, 0.1])
    parser.add_argument("--rate", type=float, default=50e6)
    parser.add_argument("--step", type=floats, default=[0.1, 0.5])
    parser.add_argument("--worlds", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--windows", type=int, default=G, help="G: windows a step, all ranks")
    parser.add_argument("--no-cache-only", action="store_true")
    parser.add_argument("--tokens", type=float, default=32e6)
    parser.add_argument("--params", type=float, default=41e6)
    parser.add_argument("--skip", choices=["loader", "checkpoint"], default=None)
    parser.add_argument("--json", type=Path)
    a = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-storage-"))
    server = S3Server.start(work)
    os.environ.update(server.env())
    results: dict = {"loader": [], "checkpoint": [], "load_before": os.getloadavg()}
    try:
        if a.skip != "loader":
            rng = np.random.default_rng(0)
            n = int(a.tokens)
            local = write_dataset(work / "data", rng.integers(1, 50000, n, dtype=np.uint16),
                                  rng.integers(1, 50000, n // 100, dtype=np.uint16), 50257,
                                  shard_tokens=n // 4, kind="gpt2")
            url = server.bucket("bench") + "/data"
            fs = server.fs()
            for path in sorted(local.iterdir(), key=lambda p: p.name == "meta.json"):
                fs.put_file(str(path), f"{url[5:]}/{path.name}")
        state = state_of(a.params) if a.skip != "checkpoint" else {}
        for delay in a.delay:
            cloud = Shaper(server.port, delay, a.rate)
            point_at(cloud.endpoint)
            for step_s in a.step if a.skip != "loader" else []:
                for world in a.worlds:
                    for cached in (False,) if a.no_cache_only else (False, True):
                        cache = tempfile.mkdtemp(dir=work) if cached else ""
                        row = {"delay_s": delay, "step_s": step_s, "W": world, "cache": cached,
                               "G": a.windows,
                               **loader_run(url, world, step_s, a.steps, cache, a.windows)}
                        results["loader"].append(row)
                        print(json.dumps(row), flush=True)
            if state:
                root = server.bucket("ckpt") + "/run"
                row = {"delay_s": delay, **checkpoint_run(root, state, 1)}
                results["checkpoint"].append(row)
                print(json.dumps(row), flush=True)
            cloud.stop()
            point_at(server.endpoint)
        results["load_after"] = os.getloadavg()
        print(json.dumps({k: results[k] for k in ("load_before", "load_after")}))
        if a.json:
            a.json.write_text(json.dumps(results, indent=1))
    finally:
        server.stop()


if __name__ == "__main__":
    main()

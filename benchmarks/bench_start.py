"""What a training start costs as the dataset grows: the loader's start per rank, and `ddpgpt
train`'s time to its first step and memory per rank, on sparse fake datasets of 2e8 and 2e10
tokens (docs/performance.md, "A start at any size").

    python -m benchmarks.bench_start --root /tmp/start [--tokens 2e8 2e10] [--nproc 2]

A fake dataset is what `ddpgpt prepare` writes, but sparse: shards of 1e8 uint16 tokens (the
default --shard-tokens) whose payload is a hole (zeros: token 0 of a byte vocabulary), a val split
of 1% of the tokens, meta.json with every shard's real sha256, and no verified.json (as a dataset
from before the cache, or copied). 2e10 tokens take 40 GB of address space and almost no disk.

Each row is a fresh set of processes: the loader (per rank r of W, in its own process: the dataset
opened and checked, data.verify's hashing of its share, the train loader built, its first step's
windows read, the eval loader built; seconds and the peak resident memory it added), then `ddpgpt
train --nproc W` with default settings but a tiny model and 1 step (seconds to the first step's
row in metrics.jsonl, the workers' peak resident memory). The first start of a dataset hashes its
shards (1/W each) and records them; the next starts find them recorded.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

HEADER = 1024
SHARD_TOKENS = 100_000_000
LOADER = """
import json, resource, sys, time
t0 = time.perf_counter()
rss0 = int(open('/proc/self/statm').read().split()[1]) * 4096
from ddpgpt.data.loader import EvalLoader, TrainLoader
from ddpgpt.data.shards import TokenDataset
try:
    from ddpgpt.data import verify
except ImportError:  # the code before verified.json: every start hashes its share
    verify = None
imported = time.perf_counter()
rss1 = int(open('/proc/self/statm').read().split()[1]) * 4096
path, rank, world = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
ds = TokenDataset(path)
if verify is None:
    ds.verify(part=rank, parts=world)
else:
    verify.record(path, verify.hash_share(ds, rank, world))
loader = TrainLoader(ds, seq_len=256, micro_batch=8, world_size=world, rank=rank, accum_steps=4,
                     seed=1337)
for x, y in loader.next_step():
    pass
val = EvalLoader(ds, seq_len=256, micro_batch=8, world_size=world, rank=rank, max_windows=256)
done = time.perf_counter()
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"seconds": done - imported, "added_mb": (peak - rss1) / 1e6,
                  "peak_mb": peak / 1e6}))
"""


def shard_header(count: int) -> bytes:
    """The 1024-byte header of a uint16 shard of `count` tokens, as `prepare` writes it."""
    return (b"DDPGPTTK" + (1).to_bytes(4, "little") + (1).to_bytes(4, "little") +
            count.to_bytes(8, "little")).ljust(HEADER, b"\0")


def fake_dataset(root: Path, tokens: int) -> Path:
    out = root / f"fake-{tokens:.0e}".replace("+", "")
    if (out / "meta.json").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    val = tokens // 100
    shards, digests = {"train": [], "val": []}, {}
    for split, n in (("train", tokens - val), ("val", val)):
        for i, start in enumerate(range(0, n, SHARD_TOKENS)):
            count = min(SHARD_TOKENS, n - start)
            path = out / f"{split}_{i:06d}.bin"
            with open(path, "wb") as f:
                f.write(shard_header(count))
                f.truncate(HEADER + 2 * count)  # a hole: no disk
            if count not in digests:  # every full shard has the same bytes
                digests[count] = _sha256(path)
            shards[split].append({"file": path.name, "tokens": count, "sha256": digests[count]})
    meta = {"format_version": 1, "tokenizer": "byte", "vocab_size": 257, "eot_id": 256,
            "dtype": "uint16", "shards": shards, "source": {"fake": True}}
    (out / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    return out


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            h.update(block)
    return h.hexdigest()


def loader_start(data: Path, world: int) -> list[dict]:
    """Each rank's loader start, in its own process, one after the other."""
    out = []
    for rank in range(world):
        proc = subprocess.run([sys.executable, "-c", LOADER, str(data), str(rank), str(world)],
                              capture_output=True, text=True, check=True)
        out.append(json.loads(proc.stdout))
    return out


def descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        try:
            children = Path(f"/proc/{parent}/task/{parent}/children").read_text().split()
        except OSError:
            continue
        found += map(int, children)
        todo += map(int, children)
    return found


def _hwm_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1e3
    except OSError:
        return None
    return None


def _is_worker(pid: int) -> bool:
    try:
        return b"RANK=" in Path(f"/proc/{pid}/environ").read_bytes() and \
            b"ddpgpt" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def train_start(data: Path, run_dir: Path, world: int) -> dict:
    """`ddpgpt train --nproc W`, default settings but a tiny model and one step: seconds to the
    first row of metrics.jsonl and each worker's peak resident memory (VmHWM, polled)."""
    cmd = [sys.executable, "-m", "ddpgpt", "train", "--data", str(data), "--run-dir",
           str(run_dir), "--nproc", str(world), "--model.n-layer", "2", "--model.n-head", "2",
           "--model.n-embd", "64", "--model.block-size", "256", "--data.micro-batch", "8",
           "--data.global-batch", "16", "--run.steps", "1", "--device", "cpu"]
    shutil.rmtree(run_dir, ignore_errors=True)
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    first, peaks = None, {}
    while proc.poll() is None:
        for pid in descendants(proc.pid):
            if _is_worker(pid) and (mb := _hwm_mb(pid)) is not None:
                peaks[pid] = max(peaks.get(pid, 0.0), mb)
        if first is None and (run_dir / "metrics.jsonl").is_file() and any(
                "loss" in line for line in (run_dir / "metrics.jsonl").read_text().splitlines()):
            first = time.perf_counter() - start
        time.sleep(0.05)
    err = proc.stderr.read()
    if proc.returncode:
        raise SystemExit(f"train failed ({proc.returncode}):\n{err[-3000:]}")
    return {"first_step_s": first, "total_s": time.perf_counter() - start,
            "worker_peak_mb": sorted(peaks.values())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default="/tmp/ddpgpt-start")
    ap.add_argument("--tokens", nargs="+", type=float, default=[2e8, 2e10])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--starts", type=int, default=3, help="train starts per dataset")
    a = ap.parse_args()
    root = Path(a.root)
    datasets = {tokens: fake_dataset(root, int(tokens)) for tokens in a.tokens}
    for i in range(a.starts):  # the sizes interleaved, so that a busy machine's drift is shared
        for tokens, data in datasets.items():
            for what in ("loader", "train"):
                if i == 0:
                    (data / "verified.json").unlink(missing_ok=True)  # the first start hashes
                row = loader_start(data, a.nproc) if what == "loader" else \
                    train_start(data, root / f"run-{tokens:.0e}", a.nproc)
                print(f"{tokens:.0e} tokens: {what} start {i + 1}:", json.dumps(row), flush=True)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()

"""What `data.align = bos` costs a training start as the dataset grows: the loader's start per
rank with rows packed from documents, against the stream's windows, at 1e8 and 1e9 tokens
(docs/performance.md, "Rows that start at documents").

    python -m benchmarks.bench_packing --root /tmp/packing [--tokens 1e8 1e9] [--nproc 2]

A dataset here is what `ddpgpt prepare` writes for a byte vocabulary, with real payload (2 bytes
a token on disk): documents of lognormal lengths (median 600 tokens, a long tail), each starting
with the end-of-text id 256 and filled with zeros; a val split of 1%; its shards' hashes recorded
(verified.json), so that a start measures the loader, not the hashing. Each start is one process
per rank, one after the other: the dataset opened, the train loader built (bos: the packing's
index read from its cache, or built and cached at the first start) and its first step's rows
read, the eval loader built; seconds, and the growth of its peak resident set (VmHWM) from
after the imports.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from benchmarks.bench_start import SHARD_TOKENS, shard_header
from ddpgpt.data import verify
from ddpgpt.data.shards import TokenDataset
from ddpgpt.files import sha256

EOT = 256
LOADER = """
import json, sys, time
from ddpgpt.data.loader import EvalLoader, TrainLoader
from ddpgpt.data.shards import TokenDataset
from ddpgpt.files import sha256
imported = time.perf_counter()
def hwm():  # this process's peak resident set since its exec (ru_maxrss keeps the parent's)
    line = next(x for x in open('/proc/self/status') if x.startswith('VmHWM'))
    return int(line.split()[1]) * 1024
rss1 = hwm()
path, rank, world, align = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
ds = TokenDataset(path)
loader = TrainLoader(ds, seq_len=1024, micro_batch=4, world_size=world, rank=rank,
                     accum_steps=4, seed=1337, align=align)
for x, y in loader.next_step():
    pass
val = EvalLoader(ds, seq_len=1024, micro_batch=4, world_size=world, rank=rank, max_windows=256,
                 align=align)
done = time.perf_counter()
peak = hwm()
print(json.dumps({"seconds": done - imported, "added_mb": (peak - rss1) / 1e6,
                  "rows": loader.stream.num_windows}))
"""


def documents_dataset(root: Path, tokens: int) -> tuple[Path, int]:
    """The dataset of `tokens` tokens and its number of documents (made once)."""
    out = root / f"docs-{tokens:.0e}".replace("+", "")
    rng = np.random.default_rng(0)
    lengths = np.maximum(2, rng.lognormal(np.log(600), 1.0, tokens // 300).astype(np.int64))
    starts = np.cumsum(lengths) - lengths
    starts = starts[starts < tokens]
    if (out / "meta.json").is_file():
        return out, len(starts)
    out.mkdir(parents=True, exist_ok=True)
    val = tokens // 100
    shards = {"train": [], "val": []}
    for split, lo, hi in (("train", 0, tokens - val), ("val", tokens - val, tokens)):
        for i, start in enumerate(range(lo, hi, SHARD_TOKENS)):
            stop = min(start + SHARD_TOKENS, hi)
            payload = np.zeros(stop - start, dtype=np.uint16)
            mine = starts[(starts >= start) & (starts < stop)] - start
            payload[mine] = EOT
            payload[0] = EOT  # a split's first token starts a document
            path = out / f"{split}_{i:06d}.bin"
            with open(path, "wb") as f:
                f.write(shard_header(len(payload)))
                payload.tofile(f)
            shards[split].append({"file": path.name, "tokens": len(payload),
                                  "sha256": sha256(path)})
    meta = {"format_version": 1, "tokenizer": "byte", "vocab_size": 257, "eot_id": EOT,
            "dtype": "uint16", "shards": shards, "source": {"fake": True}}
    (out / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    verify.record(out, verify.hash_share(TokenDataset(out)))
    return out, len(starts)


def start(data: Path, world: int, align: str) -> list[dict]:
    return [json.loads(subprocess.run(
        [sys.executable, "-c", LOADER, str(data), str(rank), str(world), align],
        capture_output=True, text=True, check=True).stdout) for rank in range(world)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", type=Path, default=Path("/tmp/packing"))
    ap.add_argument("--tokens", type=float, nargs="+", default=[1e8, 1e9])
    ap.add_argument("--nproc", type=int, default=2)
    args = ap.parse_args()
    print("| tokens | documents | align | start | rows | seconds per rank | memory added per rank"
          " |")
    print("|---:|---:|---|---|---:|---:|---:|")
    for tokens in (int(t) for t in args.tokens):
        data, docs = documents_dataset(args.root, tokens)
        for cache in data.glob("packing-*"):
            cache.unlink()
        for align, which in (("stream", "any"), ("bos", "first"), ("bos", "next")):
            ranks = start(data, args.nproc, align)
            secs = ", ".join(f"{r['seconds']:.2f}" for r in ranks)
            mem = ", ".join(f"{r['added_mb']:.1f}" for r in ranks)
            print(f"| {tokens:.0e} | {docs:,} | {align} | {which} | {ranks[0]['rows']:,} | "
                  f"{secs} s | {mem} MB |", flush=True)


if __name__ == "__main__":
    main()

"""Tokens per second that one rank of the training loader can draw (no model, CPU tensors).

    python -m benchmarks.bench_loader --data data/stdlib [--seq-len 1024] [--micro-batch 16]

Plays rank 0 of W=8 (it reads only its own 1/8 of each step), so the figure is what one training
process gets. Target: >= 20M tokens/s, so that loading never shows in a training step.
"""

import argparse
import time

from ddpgpt.data.loader import TrainLoader
from ddpgpt.data.shards import TokenDataset


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default="data/stdlib")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--micro-batch", type=int, default=16)
    p.add_argument("--world-size", type=int, default=8)
    p.add_argument("--accum", type=int, default=4)
    p.add_argument("--seconds", type=float, default=3.0)
    a = p.parse_args()
    ds = TokenDataset(a.data)
    loader = TrainLoader(ds, seq_len=a.seq_len, micro_batch=a.micro_batch, world_size=a.world_size,
                         rank=0, accum_steps=a.accum, seed=0)
    for _ in loader.next_step():  # warm the page cache and the permutation
        pass
    tokens, start = 0, time.perf_counter()
    while time.perf_counter() - start < a.seconds:
        for x, _ in loader.next_step():
            tokens += x.numel()
    elapsed = time.perf_counter() - start
    print(f"loader: {tokens / elapsed / 1e6:.1f}M tokens/s per rank (T={a.seq_len}, "
          f"b={a.micro_batch}, rank 0 of {a.world_size}, A={a.accum}, {ds.tokenizer} "
          f"{ds.dtype.name} shards)")


if __name__ == "__main__":
    main()

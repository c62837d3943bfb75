"""Causal attention in a CPU training step: SDPA's kernel against model/causal_cpu.py's formula by
blocks of queries, compiled (docs/performance.md, "Causal attention by blocks").

    python -m benchmarks.bench_causal                                    # T = 64 .. 1,024
    python -m benchmarks.bench_causal --lengths 256,512 --blocks 32,64,128 --heads 6

One attention layer's work, forward and backward: q, k and v as the model makes them (views of
one (B, T, 3·H·D) projection, transposed to (B, H, T, D)), `--tokens` tokens a batch (B =
tokens / T rows), fp32, `--threads` threads. For each length every kernel is built first (the
compile apart), then they take turns `--repeats` times; a kernel's figure is the median of its
calls (this process's CPU seconds, which a busy machine inflates less than wall time), its
ratio that over SDPA's.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch._dynamo.config as dynamo_config
import torch.nn.functional as F

from ddpgpt.model.causal_cpu import BLOCK, by_blocks


def heads(qkv: torch.Tensor, H: int, D: int) -> list[torch.Tensor]:
    """q, k, v (B, H, T, D) as the layer makes them: views of its projection (B, T, 3·H·D)."""
    B, T, _ = qkv.shape
    return [t.view(B, T, H, D).transpose(1, 2) for t in qkv.split(H * D, dim=2)]


def kernels(blocks: list[int]) -> dict:
    """name -> attention(q, k, v): SDPA's causal kernel, and the formula compiled at each block."""
    out = {"sdpa": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)}
    for b in blocks:
        out[f"blocks of {b}"] = torch.compile(lambda q, k, v, b=b: by_blocks(q, k, v, b),
                                              dynamic=False)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="64,128,256,384,512,768,1024")
    parser.add_argument("--blocks", default=str(BLOCK), help="queries a block, by commas")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    blocks = [int(b) for b in args.blocks.split(",")]
    lengths = [int(t) for t in args.lengths.split(",")]
    # One compile for each length and block: more than dynamo's default of 8 for one function.
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(dynamo_config, name):
            setattr(dynamo_config, name, max(64, 2 * len(blocks) * len(lengths)))
    calls = kernels(blocks)
    print(f"one layer, forward and backward: {args.heads} heads of {args.head_dim}, "
          f"{args.tokens} tokens a batch, fp32, {args.threads} thread(s), CPU ms, median of "
          f"{args.repeats}")
    print("| T × B | " + " | ".join(calls) + " | " + " | ".join(
        f"{name} / sdpa" for name in calls if name != "sdpa") + " | first call (s) |")
    print("|---|" + "---:|" * (2 * len(calls)))
    for T in lengths:
        B = max(1, args.tokens // T)
        qkv = torch.randn(B, T, 3 * args.heads * args.head_dim, requires_grad=True)
        dy = torch.randn(B, args.heads, T, args.head_dim)

        def step(attention, qkv=qkv, dy=dy):
            attention(*heads(qkv, args.heads, args.head_dim)).backward(dy)

        first = {}
        for name, attention in calls.items():  # built (compiled) before any is timed
            start = time.perf_counter()
            step(attention)
            first[name] = time.perf_counter() - start
        times: dict[str, list[float]] = {name: [] for name in calls}
        for _ in range(args.repeats):
            for name, attention in calls.items():
                start = time.process_time()
                step(attention)
                times[name].append(time.process_time() - start)
        ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        ratios = [f"{ms[name] / ms['sdpa']:.2f}" for name in calls if name != "sdpa"]
        compiles = max(first[name] for name in calls if name != "sdpa")
        print(f"| {T} × {B} | " + " | ".join(f"{ms[name]:.1f}" for name in calls) + " | "
              + " | ".join(ratios) + f" | {compiles:.1f} |", flush=True)


if __name__ == "__main__":
    main()

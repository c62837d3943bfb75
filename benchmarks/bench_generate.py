"""Sampling speed with and without the KV cache: tokens per second at several lengths.

    python -m benchmarks.bench_generate                       # the tiny preset's shape, CPU
    python -m benchmarks.bench_generate --preset small --device cuda --new 200 500 1000

The model is freshly initialized (speed does not depend on what it learned), the prompt is four
tokens, one sequence; the same seed gives the same tokens both ways (checked). With the cache a
token costs one token's forward, and a restart of the window (past block_size) one forward of the
half it keeps; without it every token re-encodes its whole context (up to block_size tokens).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from ddpgpt.config.presets import get_preset
from ddpgpt.model.gpt import GPT


def measure(model: GPT, new: int, use_cache: bool, device: torch.device) -> tuple[float, list]:
    prompt = torch.tensor([[1, 2, 3, 4]], device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = model.generate(prompt, new, top_k=50, generator=gen, use_cache=use_cache)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return new / (time.perf_counter() - start), out.tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1,
                        help="CPU threads (1: what `ddpgpt sample` uses for small models)")
    parser.add_argument("--new", type=int, nargs="+", default=[200, 500, 1000])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    cfg = get_preset(args.preset).model
    cfg.vocab_size = cfg.vocab_size or args.vocab
    model = GPT(cfg).to(device).eval()
    print(f"{args.preset}: {cfg.n_layer} layers x {cfg.n_embd}, block_size {cfg.block_size}, "
          f"vocab {cfg.vocab_size}; {device}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; median of {args.repeats}")
    measure(model, 20, True, device)  # warm-up
    print("| new tokens | no cache (tokens/s) | KV cache (tokens/s) | speed-up |")
    print("|---:|---:|---:|---:|")
    for new in args.new:
        rates = {True: [], False: []}
        for _ in range(args.repeats):
            # alternating: the machine's drift reaches both
            plain, plain_tokens = measure(model, new, False, device)
            cached, cached_tokens = measure(model, new, True, device)
            assert cached_tokens == plain_tokens, "the cache changed the tokens"
            rates[False].append(plain)
            rates[True].append(cached)
        plain, cached = (statistics.median(rates[c]) for c in (False, True))
        print(f"| {new} | {plain:,.0f} | {cached:,.0f} | {cached / plain:.1f}x |", flush=True)


if __name__ == "__main__":
    main()

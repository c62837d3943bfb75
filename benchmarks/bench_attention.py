"""What masked attention costs, by kernel: SDPA under the dense document mask, FlexAttention under
a block mask (compiled, and uncompiled), and SDPA's causal kernel with no mask (the floor), at
several lengths and document lengths (docs/performance.md, "Attention that skips what it masks").

    python -m benchmarks.bench_attention                          # CPU: one layer, tiny and small
    python -m benchmarks.bench_attention --device cuda --threads 0

Each row holds `tokens` tokens (B = tokens / T rows of T), with documents of geometric lengths
(mean `docs`) that cross row starts. Measured: one attention layer (the preset's width and heads,
its input requiring a gradient) and the whole model (its loss), forward and backward (flex's
backward on a CPU is model/flex_cpu.py's, torch 2.13 having none there) and forward alone
(no_grad); the median of `repeats` after a warm-up (a compile included), the kernels taking
turns so that the machine's drift reaches each. Peak memory: on
CUDA the allocator's peak above what was allocated before; on a CPU the rise of the process's
peak resident set (VmHWM, reset through /proc/self/clear_refs) in one more call. And what the mask
costs to build per step: the dense (B, 1, T, T) mask and the block mask, shared by every layer.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import re
import statistics
import time
from pathlib import Path

import torch

from ddpgpt.config.presets import get_preset
from ddpgpt.model import flex
from ddpgpt.model.attention import CausalSelfAttention, documents
from ddpgpt.model.gpt import GPT
from ddpgpt.run.precision import keep_freed_memory

BOS = 1
KERNELS = ("causal", "dense", "flex", "flex eager")  # causal: no mask at all (the floor)
M_MMAP_THRESHOLD, M_MMAP_MAX = -3, -4
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
clock = CLOCKS["wall"]


def rows(B: int, T: int, docs: int, device, seed: int = 0) -> torch.Tensor:
    """(B, T) ids with a document start about every `docs` tokens (none at a row's first)."""
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(2, 4096, (B, T), generator=gen)
    starts = torch.rand(B, T, generator=gen) < 1 / docs
    starts[:, 0] = False
    idx[starts] = BOS
    return idx.to(device)


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def kib(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))


def peak_mb(fn, device) -> float:
    """The memory one call of fn adds at its peak (see the module docstring). On a CPU, for this
    call only, glibc maps every block of 64 KiB or more on its own and unmaps it when freed, and
    gives back what it holds free first, so the resident set follows what is live."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        return (torch.cuda.max_memory_allocated(device) - before) / 2**20
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(M_MMAP_MAX, 1 << 20)
    libc.mallopt(M_MMAP_THRESHOLD, 64 << 10)
    libc.malloc_trim(0)
    try:
        Path("/proc/self/clear_refs").write_text("5")
        before = kib("VmRSS")
        fn()
        return (kib("VmHWM") - before) / 1024
    finally:
        keep_freed_memory()  # as training runs: freed blocks stay for the next call


def run(kernel: str, fn, device):
    """fn under `kernel`'s FlexAttention (compiled or not)."""
    if kernel == "flex eager":
        with flex.uncompiled(device.type):
            return fn()
    return fn()


def measure(calls: dict, device, repeats: int) -> dict:
    """{kernel: (median ms, peak MB)} of each kernel's call, after a warm-up (and its compile),
    the kernels taking turns."""
    for k, fn in calls.items():  # the warm-up
        run(k, fn, device)
    times: dict[str, list] = {k: [] for k in calls}
    for _ in range(repeats):
        for k, fn in calls.items():
            sync(device)
            start = clock()
            run(k, fn, device)
            sync(device)
            times[k].append((clock() - start) * 1e3)
    return {k: (statistics.median(times[k]), peak_mb(lambda k=k: run(k, calls[k], device), device))
            for k in calls}


def layer_calls(cfg, idx: torch.Tensor, backward: bool, device) -> dict:
    layer = CausalSelfAttention(cfg).to(device)
    x = torch.randn(*idx.shape, cfg.n_embd, device=device, requires_grad=backward)
    masks = {"causal": None, "dense": documents(idx, BOS), "flex": flex.block_mask(idx, BOS),
             "flex eager": flex.block_mask(idx, BOS)}

    def call(mask):
        def fn():
            with torch.set_grad_enabled(backward):
                y = layer(x, mask=mask)
                if backward:
                    y.sum().backward()
            return True
        return fn
    return {k: call(m) for k, m in masks.items()}


def model_calls(cfg, idx: torch.Tensor, backward: bool, device) -> dict:
    models = {"causal": dataclasses.replace(cfg, doc_mask=False),
              "dense": dataclasses.replace(cfg, attention="sdpa"),
              "flex": dataclasses.replace(cfg, attention="flex"),
              "flex eager": dataclasses.replace(cfg, attention="flex")}

    def call(model_cfg):
        model = GPT(model_cfg).to(device)

        def fn():
            with torch.set_grad_enabled(backward):
                _, loss = model(idx, idx)
                if backward:
                    loss.backward()
            return True
        return fn
    return {k: call(c) for k, c in models.items()}


def cell(result) -> str:
    return f"{result[0]:,.1f} ms · {result[1]:,.0f} MB"


def table(title: str, make, cfg, args, device) -> None:
    print(f"\n{title}\n")
    print("| T × B | documents | pass | " + " | ".join(KERNELS) + " | flex / causal |")
    print("|---|---|---|" + "---:|" * (len(KERNELS) + 1))
    for T in args.lengths:
        B = max(1, args.tokens // T)
        shaped = dataclasses.replace(cfg, block_size=T)
        for docs in args.docs:
            idx = rows(B, T, docs, device)
            for backward in (True, False):
                got = measure(make(shaped, idx, backward, device), device, args.repeats)
                ratio = f"{got['flex'][0] / got['causal'][0]:.2f}x"
                print(f"| {T} × {B} | ~{docs} | {'fwd+bwd' if backward else 'fwd'} | "
                      + " | ".join(cell(got[k]) for k in KERNELS) + f" | {ratio} |", flush=True)


def build_times(args, device) -> None:
    print("\nThe mask of one step (shared by every layer): build time, median · its size\n")
    print("| T × B | documents | dense (B, 1, T, T) | block mask |")
    print("|---|---|---:|---:|")
    size = {"dense": lambda m: m.numel() * m.element_size(),
            "block": lambda m: sum(t.numel() * t.element_size() for t in m.as_tuple()
                                   if torch.is_tensor(t))}
    for T in args.lengths:
        B = max(1, args.tokens // T)
        for docs in args.docs:
            idx = rows(B, T, docs, device)
            got, mb = {}, {}
            for name, build in (("dense", documents), ("block", flex.block_mask)):
                mb[name] = size[name](build(idx, BOS)) / 2**20
                times = []
                for _ in range(args.repeats):
                    sync(device)
                    start = clock()
                    build(idx, BOS)
                    sync(device)
                    times.append((clock() - start) * 1e3)
                got[name] = statistics.median(times)
            print(f"| {T} × {B} | ~{docs} | " + " | ".join(
                f"{got[k]:.1f} ms · {mb[k] * 1024:,.1f} KiB" for k in ("dense", "block")) + " |",
                flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads (0: torch's)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 2048])
    parser.add_argument("--docs", type=int, nargs="+", default=[1000, 200],
                        help="mean document lengths in tokens")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per batch")
    parser.add_argument("--models", nargs="*", default=["tiny", "small"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--what", nargs="+", default=["layer", "model", "build"])
    parser.add_argument("--clock", choices=CLOCKS, default="wall",
                        help="cpu: the process's CPU time (with --threads 1: what the work "
                             "costs, whatever else the machine runs)")
    args = parser.parse_args()
    global clock
    clock = CLOCKS[args.clock]
    # Every shape, pass and model is a compile of flex_attention's code: more than the 8 that
    # dynamo allows one code object before it runs it uncompiled (a run has two or three).
    torch._dynamo.config.recompile_limit = 256
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cpu":
        keep_freed_memory()
    print(f"{device}, torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"{args.tokens} tokens a batch; median of {args.repeats}, {args.clock} time · peak "
          "memory")
    for name in args.models:
        cfg = dataclasses.replace(get_preset(name).model, vocab_size=4096, doc_mask=True,
                                  bos_id=BOS).resolved()
        shape = f"{name}: {cfg.n_layer} layers × {cfg.n_embd}, {cfg.n_head} heads, {cfg.arch}"
        if "layer" in args.what:
            table(f"One attention layer of {shape}", layer_calls, cfg, args, device)
        if "model" in args.what:
            table(f"The model, {shape}", model_calls, cfg, args, device)
    if "build" in args.what:
        build_times(args, device)


if __name__ == "__main__":
    main()

"""One training step on a CPU, ddpgpt's models against nanoGPT's at the same shape, taking turns.

    python -m benchmarks.bench_step --nanogpt ~/src/nanoGPT                # the speedrun shape
    python -m benchmarks.bench_step --nanogpt ~/src/nanoGPT --vocab 4096 --steps 20
    python -m benchmarks.bench_step --profile modern-muon                  # where a step goes

The shape is the speedrun preset's: 4 layers × 256 wide, 4 heads, T=256, 16 sequences a step,
fp32, `--threads` threads (1: as the speedrun benchmark paces). Each variant is a model and an
optimizer; a step is forward, backward (`--micro` micro-batches of 16/micro sequences, the
gradients accumulated) and the optimizer's step:

- `nanogpt`: nanoGPT's own `model.py` (imported from the clone, unmodified: no biases, exact
  GELU, tied head) and its `configure_optimizers` AdamW (wd 0.1, betas 0.9/0.95), one batch of 16;
- `gpt2-adamw`: ddpgpt's GPT-2 model as the speedrun benchmark's `adamw` recipe trains it;
- `modern-adamw`: the speedrun preset's model (model.arch modern) with the same AdamW: the
  model's cost against nanoGPT's, optimizer alike;
- `modern-muon`: the speedrun preset's model and optimizer (its Muon, in fp32 with MuonEq-R, for
  the blocks' matrices, AdamW for the rest) and its two micro-batches of 8: the step the preset
  trains alone (the speedrun benchmark trains one batch of 16: `modern-muon:micro=1`).

A ddpgpt variant takes model settings after a colon, to price one piece of the model:
`modern-adamw:norm=layernorm`, `modern-adamw:qk_norm=false,rope=false`,
`modern-adamw:mlp_hidden=704` (digits are a number); and `micro=N`, the
micro-batches a step of 16 sequences is cut into (`modern-muon:micro=1`).

Every variant is built first, then they take turns a step at a time, `--steps` turns (the first
`--warmup` dropped); a variant's figure is the median over its steps (wall seconds, and this
process's CPU seconds, which a busy machine inflates less), its ratio to nanoGPT's the median
over the turns of the ratio within a turn (both saw the same load). The 1-minute load
average is printed at the start and end. `--compile` adds each variant compiled
(torch.compile of the model, before its first step) and reports its first step (the compile)
apart. `--profile VARIANT` prints torch.profiler's table of a few steps of that variant by op
(self CPU time), and the share of forward, backward and optimizer. `--newton-schulz` times
Muon's iteration alone over the shape's matrices, the x-form against the Gram form
(optim/muon.py), taking turns.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from ddpgpt.config.model import ModelConfig
from ddpgpt.config.optim import OptimConfig
from ddpgpt.config.presets import get_preset
from ddpgpt.model.gpt import GPT
from ddpgpt.optim import optimizer as optim
from ddpgpt.run import precision

B, T, LAYERS, HEADS, WIDTH = 16, 256, 4, 4, 256


def _nanogpt(path: Path, vocab: int):
    spec = importlib.util.spec_from_file_location("nanogpt_model", path / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cfg = module.GPTConfig(block_size=T, vocab_size=vocab, n_layer=LAYERS, n_head=HEADS,
                           n_embd=WIDTH, dropout=0.0, bias=False)
    model = module.GPT(cfg)
    opt = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95), "cpu")
    return model, opt, 1


def _ddpgpt(arch: str, vocab: int, muon: bool, pieces: dict):
    extra = {} if arch == "modern" else {"bias": False, "gelu": "exact"}
    extra.update(pieces)
    model = GPT(ModelConfig(n_layer=LAYERS, n_head=HEADS, n_embd=WIDTH, block_size=T,
                            vocab_size=vocab, arch=arch, **extra), seed=1337)
    cfg = (get_preset("speedrun").optim if muon
           else OptimConfig(name="adamw", lr=1e-3, min_lr=1e-4))
    groups = optim.groups(model, cfg)
    opt = optim.Optimizer(groups, [g.params for g in groups], cfg, torch.device("cpu"),
                          ns_dtype=torch.float32)
    return model, opt, 2 if muon else 1


def build(name: str, args):
    if name == "nanogpt":
        return _nanogpt(args.nanogpt, args.vocab)
    name, _, changes = name.partition(":")  # e.g. modern-adamw:norm=layernorm,qk_norm=false
    pieces = dict(c.split("=", 1) for c in changes.split(",") if c)
    pieces = {k: {"true": True, "false": False}.get(v, int(v) if v.isdigit() else v)
              for k, v in pieces.items()}
    micro = int(pieces.pop("micro", 0))
    model, opt, default = _ddpgpt(name.split("-")[0], args.vocab, name.endswith("muon"), pieces)
    return model, opt, micro or default


def split_variants(text: str) -> list[str]:
    """--variants: names by commas, a variant's own settings after its colon by commas too
    ("nanogpt,modern-adamw:rope=false,qk_norm=false,modern-muon")."""
    variants: list[str] = []
    for item in text.split(","):
        if "=" in item and ":" not in item and variants:
            variants[-1] += "," + item
        else:
            variants.append(item)
    return variants


def step(model, opt, micro: int, x: torch.Tensor, y: torch.Tensor) -> None:
    for xs, ys in zip(x.chunk(micro), y.chunk(micro)):
        with torch.profiler.record_function("forward"):
            _, loss = model(xs, ys)
        with torch.profiler.record_function("backward"):
            (loss / micro).backward()
    with torch.profiler.record_function("optimizer"):
        opt.step()
        opt.zero_grad(set_to_none=True)


def batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return (torch.randint(0, vocab, (B, T), generator=gen),
            torch.randint(0, vocab, (B, T), generator=gen))


def turns(keys: list[tuple[str, bool]], args) -> dict[str, dict]:
    """Every variant built, then one step of each in turn, `--steps` times: each step of one
    variant sits between steps of the others, under the same load. Wall and CPU seconds (this
    process's: the time the scheduler gave it, which another process's load inflates less)."""
    built = {}
    for name, compiled in keys:
        torch.manual_seed(0)
        model, opt, micro = build(name, args)
        built[name + (" compiled" if compiled else "")] = (
            torch.compile(model) if compiled else model, opt, micro)
    x, y = batch(args.vocab)
    times = {key: {"wall": [], "cpu": []} for key in built}
    for _ in range(args.steps):
        for key, (model, opt, micro) in built.items():
            wall, cpu = time.perf_counter(), time.process_time()
            step(model, opt, micro, x, y)
            times[key]["wall"].append(time.perf_counter() - wall)
            times[key]["cpu"].append(time.process_time() - cpu)
    return times


def profile(name: str, args) -> None:
    model, opt, micro = build(name, args)
    x, y = batch(args.vocab)
    for _ in range(3):
        step(model, opt, micro, x, y)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            step(model, opt, micro, x, y)
    table = prof.key_averages()
    phases = {e.key: e.cpu_time_total for e in table if e.key in ("forward", "backward",
                                                                   "optimizer")}
    total = sum(phases.values())
    print(f"{name}: " + ", ".join(f"{k} {v / 1e3 / args.steps:.1f} ms ({v / total:.0%})"
                                  for k, v in phases.items()))
    print(table.table(sort_by="self_cpu_time_total", row_limit=args.rows))


def newton_schulz_turns(args) -> None:
    """Newton-Schulz in fp32 over the speedrun shape's Muon matrices (per layer: qkv 768 x 256,
    proj 256 x 256, gate and fc F x 256, proj 256 x F, F the MLP's width, 704; four layers), one
    step's worth: the x-form everywhere against the Gram form where it applies, taking turns
    `--steps` times."""
    from ddpgpt.optim import muon
    gen = torch.Generator().manual_seed(0)
    F = ModelConfig(n_embd=WIDTH).resolved().mlp_hidden
    shapes = [(3 * WIDTH, WIDTH), (WIDTH, WIDTH), (F, WIDTH), (F, WIDTH), (WIDTH, F)] * LAYERS
    grads = [torch.randn(s, generator=gen) for s in shapes]
    polys = muon.ns_polynomials("quintic", 5)
    ratios = {"x-form": float("inf"), "gram": muon.GRAM_RATIO}
    times: dict[str, list[float]] = {k: [] for k in ratios}
    for _ in range(args.steps):
        for name, ratio in ratios.items():
            muon.GRAM_RATIO = ratio
            start = time.process_time()
            for g in grads:
                muon.newton_schulz(g, polys, 1e-7)
            times[name].append(time.process_time() - start)
    muon.GRAM_RATIO = ratios["gram"]
    for name, t in times.items():
        print(f"| Newton-Schulz, fp32, {name} | {statistics.median(t[args.warmup:]) * 1e3:.1f} ms "
              "CPU a step |")


def load() -> str:
    return f"{os.getloadavg()[0]:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nanogpt", type=Path, default=os.environ.get("NANOGPT"),
                        help="a clone of github.com/karpathy/nanoGPT (default: $NANOGPT)")
    parser.add_argument("--vocab", type=int, default=257, help="vocabulary (257: bytes)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=12, help="turns")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--variants", default="nanogpt,modern-adamw,modern-muon")
    parser.add_argument("--compile", action="store_true", help="each variant compiled as well")
    parser.add_argument("--profile", metavar="VARIANT", help="torch.profiler's table, by op")
    parser.add_argument("--rows", type=int, default=25, help="--profile: rows of the table")
    parser.add_argument("--newton-schulz", action="store_true",
                        help="Muon's iteration alone: the x-form against the Gram form")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    precision.keep_freed_memory()  # as the trainer runs on a CPU; nanoGPT's step gains alike
    variants = split_variants(args.variants)
    needs = [args.profile] if args.profile else [] if args.newton_schulz else variants
    if args.nanogpt is None and "nanogpt" in needs:
        raise SystemExit("bench_step: nanogpt needs --nanogpt DIR (a clone of "
                         "github.com/karpathy/nanoGPT) or $NANOGPT; or leave it out of --variants")
    if args.profile:
        profile(args.profile, args)
        return
    if args.newton_schulz:
        newton_schulz_turns(args)
        return
    keys = [(v, False) for v in variants] + ([(v, True) for v in variants] if args.compile
                                              else [])
    print(f"shape {LAYERS}x{WIDTH}, T={T}, B={B}, vocab {args.vocab}, {args.threads} thread(s); "
          f"load {load()}")
    times = turns(keys, args)
    print(f"load at end {load()}")
    report(times, args.warmup)


def report(times: dict[str, dict], warmup: int) -> None:
    """Per variant: the median step (wall and CPU seconds) after `warmup` steps, its tokens/s,
    and the median over the turns of its step over nanoGPT's in the same turn."""
    base = times.get("nanogpt")
    print("| variant | step, wall | step, CPU | tokens/s (wall) | × nanoGPT's step: wall, CPU "
          "| first step |\n|---|---:|---:|---:|---:|---:|")
    for key, t in times.items():
        wall, cpu = (statistics.median(t[k][warmup:]) for k in ("wall", "cpu"))
        ratios = [(statistics.median(a / b for a, b in zip(t[k][warmup:], base[k][warmup:]))
                   if base else float("nan")) for k in ("wall", "cpu")]
        print(f"| {key} | {wall * 1e3:.1f} ms | {cpu * 1e3:.1f} ms | {B * T / wall:,.0f} | "
              f"{ratios[0]:.3f}, {ratios[1]:.3f} | {t['wall'][0]:.1f} s |")
    sys.stdout.flush()


if __name__ == "__main__":
    main()

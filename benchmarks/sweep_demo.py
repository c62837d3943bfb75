"""The demo's config: a small sweep for the lowest val bits per byte within its budget.

    python -m benchmarks.sweep_demo [--data data/stdlib] [--out runs/sweep] [--nproc 2]

Every candidate trains the tiny preset's budget — 200 steps of 4,096 tokens (0.8M tokens) on
`--nproc` CPU processes, which `make demo` must finish in about 5 minutes — and changes one or two
things at a time: the optimizer (Muon for the matrices), its learning rates, the sequence length
(with the global batch raised to keep the tokens per step). Each run goes into OUT/NAME (a
finished run is not trained again, so the table can be printed again), evaluated on all val
windows. The table gives val loss and val bits per byte at the end, the wall time of the
training and its tokens/s; docs/performance.md ("The demo's config") holds its results.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

DEMO = ["--optim.name", "muon", "--model.block-size", "128", "--data.global-batch", "32"]
CANDIDATES = {
    "adamw (the old demo)": [],
    "adamw lr 4e-3": ["--optim.lr", "4e-3", "--optim.min-lr", "4e-4"],
    "muon": ["--optim.name", "muon"],
    "muon, muon_lr 0.04": ["--optim.name", "muon", "--optim.muon-lr", "0.04"],
    "muon, T 128 × G 32": ["--optim.name", "muon", "--data.seq-len", "128",
                           "--data.global-batch", "32"],
    # the same with the position table cut to 128 (`make demo`): no untrained positions to sample
    "muon, block 128 × G 32": DEMO,
}


def slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name).strip("-").replace("--", "-")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default="data/stdlib")
    parser.add_argument("--out", default="runs/sweep")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--only", nargs="*", help="names of candidates to run (default: all)")
    args = parser.parse_args()
    rows = []
    for name, extra in CANDIDATES.items():
        if args.only and name not in args.only:
            continue
        run = Path(args.out) / slug(name)
        cmd = [sys.executable, "-m", "ddpgpt", "train", "--data", args.data, "--preset", "tiny",
               "--run-dir", str(run), "--device", "cpu", "--nproc", str(args.nproc),
               "--data.eval-windows", "0", *extra]
        start = time.perf_counter()
        if not (run / "metrics.jsonl").is_file():
            print("$", " ".join(cmd), flush=True)
            subprocess.run(cmd, check=True)
        wall = time.perf_counter() - start
        metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        last = [r for r in metrics if "val_loss" in r][-1]
        train = [r for r in metrics if "tokens_per_s" in r]
        rows.append((name, last["val_loss"], last.get("val_bpb", float("nan")),
                     train[-1]["elapsed_s"], train[-1]["tokens"] / train[-1]["elapsed_s"], wall))
        print(f"{name}: val_bpb {rows[-1][2]:.4f}", flush=True)
    print("\n| candidate | val loss | val bits per byte | training (s) | tokens/s |")
    print("|---|---:|---:|---:|---:|")
    for name, loss, bpb, elapsed, tps, _ in sorted(rows, key=lambda r: r[2]):
        print(f"| {name} | {loss:.4f} | {bpb:.4f} | {elapsed:.0f} | {tps:,.0f} |")


if __name__ == "__main__":
    main()

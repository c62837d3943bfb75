"""AdamW against Muon on the same data, tokens and seeds: val loss at equal steps, the steps Muon
needs to reach AdamW's final val loss, and the time per step.

    python -m benchmarks.bench_optim [--data data/stdlib] [--preset tiny] [--nproc 2] \\
        [--eval-every 20] [--out runs/optim-tiny] [--muon-lr 0.02]

Two `ddpgpt train` runs (the preset's defaults; the Muon run adds `--optim.name muon`), each in
OUT/adamw and OUT/muon; a finished run is not trained again, so the report can be redrawn. Then
the table, and `ddpgpt plot` of both runs into OUT/optim.png.

Targets (tiny preset, CPU): Muon reaches AdamW's final val loss in at most 75% of the steps, with a
time per step at most 10% above AdamW's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path


def train(args, name: str, extra: list[str]) -> Path:
    run_dir = Path(args.out) / name
    cmd = [sys.executable, "-m", "ddpgpt", "train", "--data", args.data, "--preset", args.preset,
           "--run-dir", str(run_dir), "--device", "cpu", "--run.eval-every", str(args.eval_every),
           *(["--nproc", str(args.nproc)] if args.nproc > 1 else []), *extra]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    return run_dir


def read(run_dir: Path) -> tuple[dict[int, float], list[float]]:
    """{step: val_loss}, and the seconds per step of each logged row after the first few."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    val = {r["step"]: r["val_loss"] for r in rows if "val_loss" in r}
    train_rows = [r for r in rows if "tokens_per_s" in r]
    per_token = [r["tokens"] / r["step"] / r["tokens_per_s"] for r in train_rows[5:]]
    return val, per_token


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="data/stdlib")
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--eval-every", type=int, default=20)
    parser.add_argument("--out", default="runs/optim-tiny")
    parser.add_argument("--muon-lr", type=float, default=None, help="default: the config's")
    args = parser.parse_args()
    adamw = train(args, "adamw", [])
    muon = train(args, "muon", ["--optim.name", "muon", *(
        ["--optim.muon-lr", str(args.muon_lr)] if args.muon_lr else [])])
    (a_val, a_time), (m_val, m_time) = read(adamw), read(muon)
    target = a_val[max(a_val)]
    reached = min((s for s, v in m_val.items() if v <= target), default=None)
    print(f"\n{'step':>6s} {'AdamW val':>10s} {'Muon val':>10s}")
    for step in sorted(a_val):
        print(f"{step:6d} {a_val[step]:10.4f} {m_val.get(step, float('nan')):10.4f}")
    a_s, m_s = statistics.median(a_time), statistics.median(m_time)
    print(f"\nAdamW's final val loss {target:.4f} (step {max(a_val)}); Muon reaches it at "
          + (f"step {reached} ({reached / max(a_val):.0%} of the steps)" if reached else
             "no evaluated step") + f"; its final val loss {m_val[max(m_val)]:.4f}")
    print(f"seconds per step (median of logged rows): AdamW {a_s:.3f}, Muon {m_s:.3f} "
          f"({m_s / a_s - 1:+.1%})")
    subprocess.run([sys.executable, "-m", "ddpgpt", "plot", str(adamw), str(muon), "--out",
                    str(Path(args.out) / "optim.png")], check=False)


if __name__ == "__main__":
    main()

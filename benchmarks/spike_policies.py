"""What each loss-spike policy does to runs that spike: the table in docs/reliability.md.

    python -m benchmarks.spike_policies [--configs heal lr-high ...] [--policies none stop recover]
                                        [--seeds 1337 ...] [--out runs/spikes]

Each config is a short CPU run on a byte-level corpus that spikes for a real reason: a tiny AdamW
model that heals by itself, a learning rate 10× too high, fp16 past its range, Muon at an extreme
lr, a garbage batch (fault injection: random tokens, so its loss and its gradient are real), a
domain shift (unshuffled data whose last quarter is the same English with its letters mapped to
others: no batch is bad, the data changed). Each
runs once per policy (`run.on_spike`) and seed, in OUT/CONFIG/POLICY-sSEED (a finished run is not
trained again, so the table can be printed again). The table gives the outcome (exit code, the
actions taken: skipped steps, rollbacks, let-through spikes), the highest training loss after
warmup and the final val loss: that of the last step's evaluation, or for a run that stopped, of
its newest checkpoint (`ddpgpt eval`), marked with the step. Noise is the spread of `none`'s final
val loss over the seeds of each config.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path
from typing import get_args

from ddpgpt.config.choices import OnSpike

LICENSES = Path("/usr/share/common-licenses")
TINY2 = ["--preset", "tiny", "--model.n-layer", "2", "--data.global-batch", "8",
         "--data.micro-batch", "4"]
# name: (corpus, flags, steps, DDPGPT_FAULT); every run evaluates all val windows at its end
CONFIGS = {
    # AdamW spikes to 10.5 at step 15 and heals by step 17 (Debian's license texts)
    "heal": ("licenses", TINY2 + ["--run.checkpoint-every", "5"], 60, None),
    # global batches 40-42 are random tokens: a real loss and a real gradient
    "garbage": ("stdlib", TINY2 + ["--run.checkpoint-every", "10"], 100,
                ",".join(f"garbage@{k}" for k in range(40, 43))),
    # lr 1 reached by a slow warmup, no clipping: the loss drifts up from step ~100
    "lr-high": ("stdlib", TINY2 + ["--optim.lr", "1", "--optim.min-lr", "0.1",
                                   "--optim.warmup-steps", "500", "--optim.grad-clip", "0",
                                   "--run.checkpoint-every", "10"], 120, None),
    # fp16 at lr 1 (warmup 200): activations leave fp16's range, the loss turns non-finite
    "fp16": ("stdlib", TINY2 + ["--run.precision", "fp16", "--optim.lr", "1",
                                "--optim.min-lr", "0.1", "--optim.warmup-steps", "200",
                                "--run.checkpoint-every", "10"], 120, None),
    # 57 English documents then 19 of them with their letters mapped (rot13), in that order:
    # the data changes at step ~80 for good; checkpoints every 5, keep_checkpoints 3
    "shift": ("shift", TINY2 + ["--data.shuffle", "false", "--run.checkpoint-every", "5"], 150,
              None),
    # Muon at 500× its lr: slow, but it does not spike
    "muon-high": ("stdlib", TINY2 + ["--optim.name", "muon", "--optim.muon-lr", "10",
                                     "--optim.warmup-steps", "50", "--run.checkpoint-every", "10"],
                  120, None),
}


def shift_corpus(root: Path) -> Path:
    """57 English documents of ~2.8 KB (Debian's license texts cut at paragraphs), then the first
    19 of them again with every letter mapped to a Greek one (other bytes, as another script or
    language would be): en-NN.txt sort before xx-NN.txt."""
    out = root / "corpus-shift"
    out.mkdir(parents=True, exist_ok=True)
    greek = "αβγδεζηθικλμνξοπρστυφχψωϊϋ"
    mapping = str.maketrans("abcdefghijklmnopqrstuvwxyz" + "ABCDEFGHIJKLMNOPQRSTUVWXYZ",
                            greek + greek.upper())
    docs, doc = [], ""
    for path in sorted(LICENSES.iterdir()):
        for paragraph in path.read_text().split("\n\n"):
            doc += paragraph + "\n\n"
            if len(doc) >= 2800:
                docs.append(doc)
                doc = ""
    for i, doc in enumerate(docs[:57]):
        (out / f"en-{i:02d}.txt").write_text(doc)
    for i, doc in enumerate(docs[:19]):
        (out / f"xx-{i:02d}.txt").write_text(doc.translate(mapping))
    return out


def prepare(corpus: str, root: Path) -> Path:
    out = root / f"data-{corpus}"
    if not (out / "meta.json").is_file():
        sources = [str(LICENSES)] if corpus == "licenses" else \
            [str(shift_corpus(root))] if corpus == "shift" else []
        subprocess.run([sys.executable, "-m", "ddpgpt", "prepare", *sources, "--tokenizer",
                        "byte", "--out", str(out)], check=True, stdout=subprocess.DEVNULL)
    return out


def rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def newest_val_loss(run_dir: Path) -> tuple[float, int] | None:
    """(val loss, step) of the newest checkpoint, through `ddpgpt eval`."""
    proc = subprocess.run([sys.executable, "-m", "ddpgpt", "eval", "--run-dir", str(run_dir),
                           "--device", "cpu", "--windows", "0"], capture_output=True, text=True)
    loss = re.search(r"val_loss[ =:]+([0-9.naif]+)", proc.stdout + proc.stderr)
    step = re.search(r"step[ _]0*(\d+)", proc.stdout + proc.stderr)
    return (float(loss[1]), int(step[1]) if step else -1) if loss else None


def run_one(config: str, policy: str, seed: int, root: Path, threads: int) -> dict:
    corpus, flags, steps, fault = CONFIGS[config]
    data = prepare(corpus, root)
    run_dir = root / config / f"{policy}-s{seed}"
    done = run_dir / "outcome.json"
    if done.is_file():
        return json.loads(done.read_text())
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "ddpgpt", "train", "--data", str(data), *flags,
           "--run.steps", str(steps), "--run.eval-every", "0", "--data.eval-windows", "0",
           "--run.on-spike", policy, "--run.seed", str(seed), "--data.seed", str(seed),
           "--run-dir", str(run_dir), "--device", "cpu", "--run.threads", str(threads),
           "--reset"]
    env = {**os.environ, **({"DDPGPT_FAULT": fault} if fault else {})}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("ddpgpt:")]
    metrics = rows(run_dir)
    losses = [r["loss"] for r in metrics if "loss" in r]
    warm = [x for x in losses[20:] if x is not None]
    evals = [r for r in metrics if "val_loss" in r]
    # what the run computed: its steps, and those a rollback undid (cut from metrics.jsonl)
    undone = sum(int(m[1]) - int(m[2]) for m in re.finditer(
        r"warning: step (\d+): .*rolling back to step (\d+)", proc.stderr))
    said = {kind: len(re.findall(pattern, proc.stderr)) for kind, pattern in (
        ("rollback", "rolling back to step"), ("skip", "update is skipped"),
        ("shift", "the data itself has changed"))}
    outcome = {"config": config, "policy": policy, "seed": seed, "exit": proc.returncode,
               "computed": steps + undone, "said": said, "to_zero": proc.stderr.count(
                   "rolling back to step 0 "),
               "steps": max((r["step"] for r in metrics if "loss" in r), default=0),
               "max_loss": max(warm, default=math.nan) if warm else math.nan,
               "events": [r for r in metrics if "event" in r], "last_line": lines[-1:]}
    if evals and evals[-1]["step"] == steps:
        outcome["val_loss"], outcome["val_step"] = evals[-1]["val_loss"], steps
    elif (found := newest_val_loss(run_dir)) is not None:
        outcome["val_loss"], outcome["val_step"] = found
    run_dir.mkdir(parents=True, exist_ok=True)
    done.write_text(json.dumps(outcome) + "\n")
    return outcome


def describe(o: dict) -> str:
    kinds: dict[str, int] = {}
    for e in o["events"]:
        kinds[e["event"]] = kinds.get(e["event"], 0) + 1
    what = ", ".join(f"{n} {k}" for k, n in kinds.items()) or "no action"
    return f"exit {o['exit']}; {what}"


def table(outcomes: list[dict], steps: dict[str, int]) -> str:
    out = ["| config | policy | seed | outcome | highest loss after step 20 | final val loss |",
           "|---|---|---:|---|---:|---:|"]
    for o in outcomes:
        val = o.get("val_loss")
        where = "" if o.get("val_step") == steps[o["config"]] else f" (step {o.get('val_step')})"
        out.append(f"| {o['config']} | {o['policy']} | {o['seed']} | {describe(o)} | "
                   f"{o['max_loss']:.3g} | "
                   f"{'—' if val is None else f'{val:.4f}'}{where} |")
    noise = []
    for config in steps:
        vals = [o["val_loss"] for o in outcomes if o["config"] == config and o["policy"] == "none"
                and o.get("val_step") == steps[config] and math.isfinite(o["val_loss"])]
        if len(vals) > 1:
            noise.append(f"{config}: none's final val loss over {len(vals)} seeds "
                         f"{min(vals):.4f}–{max(vals):.4f} (sd {statistics.stdev(vals):.4f})")
    return "\n".join(out + ([""] + noise if noise else []))


def alarms(run_dir: Path, window: int, ratio: float) -> list[int]:
    """The steps of a finished run whose loss the detector (run.spike_window, run.spike_ratio)
    would have taken for a spike: its false alarms, on a healthy run."""
    from ddpgpt.config.schema import RunConfig
    from ddpgpt.guard.spike import SpikePolicy

    policy, found = SpikePolicy(RunConfig(spike_window=window, spike_ratio=ratio)), []
    for row in rows(run_dir):
        if row.get("loss") is None:
            continue
        if policy.outlier(row["loss"]):
            found.append(row["step"])  # a skipped step's loss never joins the window
        else:
            policy.healthy(row["step"], row["loss"], batch=row["step"] - 1)
    return found


def replay(run_dirs: list[str], windows: list[int], ratio: float) -> None:
    print("| healthy run | steps | " + " | ".join(f"alarms, window {w}" for w in windows) + " |")
    print("|---|---:|" + "---:|" * len(windows))
    for run in map(Path, run_dirs):
        steps = sum(1 for r in rows(run) if r.get("loss") is not None)
        found = [alarms(run, w, ratio) for w in windows]
        print(f"| {run} | {steps} | " + " | ".join(
            f"{len(f)}" + (f" (steps {', '.join(map(str, f[:5]))})" if f else "") for f in found)
              + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replay", nargs="+", metavar="RUN_DIR",
                    help="count the detector's alarms over these finished healthy runs instead")
    ap.add_argument("--windows", nargs="+", type=int, default=[10, 20])
    ap.add_argument("--ratio", type=float, default=2.0)
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--policies", nargs="+", default=list(get_args(OnSpike)),
                    choices=get_args(OnSpike))
    ap.add_argument("--seeds", nargs="+", type=int, default=[1337])
    ap.add_argument("--out", default="runs/spikes")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    if args.replay:
        return replay(args.replay, args.windows, args.ratio)
    root = Path(args.out)
    outcomes = []
    for config in args.configs:
        for seed in args.seeds:
            for policy in args.policies:
                o = run_one(config, policy, seed, root, args.threads)
                print(f"{config} {policy} s{seed}: {describe(o)}, val {o.get('val_loss')}",
                      file=sys.stderr, flush=True)
                outcomes.append(o)
    print(table(outcomes, {c: CONFIGS[c][2] for c in args.configs}))


if __name__ == "__main__":
    main()

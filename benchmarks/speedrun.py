"""Time to a validation loss, side by side with nanoGPT: the speedrun measure on this machine.

    python -m benchmarks.speedrun --nanogpt ~/src/nanoGPT                  # the stdlib's bytes
    python -m benchmarks.speedrun --nanogpt ~/src/nanoGPT --corpus bpe --seeds 3 --pace 2
    python -m benchmarks.speedrun --nanogpt ~/src/nanoGPT --corpus prose   # Vim's help, bpe
    python -m benchmarks.speedrun --corpus data/mytext --target 3.9        # no nanoGPT

`--corpus`: bytes or bpe (the stdlib's sources as byte or bpe-4096 tokens), prose (Vim's help) or
perl (Perl's documentation), benchmarks/prose.py's jsonl as bpe-4096 tokens, a prepared dataset
directory (meta.json), or a directory of text (`ddpgpt prepare` reads it; `--tokenizer`).
Whatever is prepared here is cached
under the work dir and prepared again only when the text's files (names, sizes, mtimes) change.

nanoGPT (a clone of github.com/karpathy/nanoGPT, passed by path and run unmodified) trains its
own `train.py` on the corpus's tokens: 4 layers × 256 wide, T=256, 16 sequences a step, AdamW at
lr 1e-3 → 1e-4 (cosine, warmup 50), 500 steps, fp32, `--threads` threads. Its checkpoint is then
scored by ddpgpt's evaluator (`ddpgpt.evals.loss.evaluate`) on every val window ddpgpt evaluates,
so its final val loss and ddpgpt's come from one evaluator; the mean of those over the seeds is
the target. Each ddpgpt recipe trains on the same prepared tokens and is evaluated on the same
windows every `--eval-every` steps; its time to target is the training seconds (`train_s`:
evaluations and checkpoints apart) at the first evaluation at or below the target, so it is an
upper bound by up to `--eval-every` steps. nanoGPT's training seconds are the sum of its logged
step times over its 500 steps (its first step holds a one-batch evaluation, ~0.1 s).

`--seeds N`: seeds 0 .. N-1, each a run of nanoGPT and then of every recipe, taking turns so that
both see the same load. Seed k is nanoGPT's torch seed 1337 + k (benchmarks/nanogpt.py says how,
its files untouched) and ddpgpt's `--run.seed` and `--data.seed` 1337 + k (the init and the data
order). Every figure is the mean over the seeds and, for several, its range (min–max); `×
nanoGPT's time` divides each seed's time to target by the time of the nanoGPT run it took turns
with. Each run records the 1-minute load average (`uptime`) at its start and end; the table's
load is their mean. A finished run is read back rather than trained again when its config is the
same (ddpgpt: `ddpgpt train --print-config`; nanoGPT: its files, flags, seed, threads and
tokens), so seeds and recipes can be added by later calls, or trained by calls side by side (and
then their times are not comparable: see --pace).

`--pace R`: after the full runs, R rounds of 30-step runs, nanoGPT and then each recipe, taking
turns; each run's s/step is the median of its steps after the 5th. `× nanoGPT's time, paced` is
(a seed's steps to target × the median over the rounds of the recipe's s/step over nanoGPT's in
the same round) / 500: the time ratio from figures that do not depend on the load (steps) and a
per-step ratio measured under one load, for a machine whose load moves during the full runs.

Without a snapshot (no `--nanogpt`, no $NANOGPT) nanoGPT is skipped with one line, and `--target`
stands in for its loss; with both, `--target` is the loss to reach (nanoGPT's mean recorded
earlier, say) and nanoGPT runs only for `--pace`. Runs go into WORK/<corpus>/<seed>/ (the
paced ones into WORK/<corpus>/pace/); the table is printed as Markdown and written with every
figure to WORK/<corpus>.json. docs/performance.md ("Time to a loss") holds the results.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from benchmarks import nanogpt, prose

# Every recipe: 16 sequences of 256 tokens a step, the tiny preset's 4 × 256 model, on
# --nproc processes.
RECIPES = {
    # nanoGPT's model (no biases, exact GELU), optimizer and schedule, exactly
    "adamw": ["--preset", "tiny", "--model.arch", "gpt2", "--model.bias", "false",
              "--model.gelu", "exact", "--optim.name", "adamw", "--optim.lr", "1e-3",
              "--optim.min-lr", "1e-4", "--optim.warmup-steps", "50", "--run.steps", "500"],
    # the tiny preset's Muon on GPT-2's model, as the demo trained before the speedrun
    "muon": ["--preset", "tiny", "--model.arch", "gpt2", "--optim.name", "muon",
             "--run.steps", "500"],
    # the `speedrun` preset (docs/performance.md, "Time to a loss")
    "speedrun": ["--preset", "speedrun"],
    # the same for as many steps as the others: its final quality at equal steps
    "speedrun-500": ["--preset", "speedrun", "--run.steps", "500"],
}
DEFAULT_RECIPES = "adamw,muon,speedrun"
PACE_STEPS, PACE_SKIP = 30, 5
BUILTIN = {"bytes": ("stdlib", "byte"), "bpe": ("stdlib", "bpe"), "prose": (None, "bpe"),
           "perl": (None, "bpe")}


def prepare(corpus: str, work: Path, tokenizer: str = "bpe") -> tuple[str, Path]:
    """The corpus's name and its prepared dataset (module docstring), prepared once."""
    if corpus in BUILTIN:
        source, tokenizer = BUILTIN[corpus]
        if source is None:  # prose or perl: benchmarks/prose.py builds it
            source = str(prose.build(work / f"{corpus}-text", source=corpus))
        name = corpus
    else:
        path = Path(corpus).expanduser()
        if (path / "meta.json").is_file():
            return path.resolve().name, path
        if not path.is_dir():
            raise SystemExit(f"speedrun: --corpus {corpus!r} is neither bytes, bpe, prose, a "
                             "prepared dataset (meta.json) nor a directory of text")
        source, name = str(path), f"{path.resolve().name}-{tokenizer}"
    out = work / f"data-{name}"
    stamp = json.dumps(_listing(source), sort_keys=True)
    if not (out / "meta.json").is_file() or _read(out / "source.json") != stamp:
        subprocess.run([sys.executable, "-m", "ddpgpt", "prepare", source, "--tokenizer",
                        tokenizer, "--out", str(out), "--force"], check=True)
        (out / "source.json").write_text(stamp)
    return name, out


def _listing(source: str) -> list | str:
    """What a prepared copy of `source` depends on: its files' names, sizes and mtimes."""
    if source == "stdlib":
        return [sys.version, "stdlib"]
    files = [Path(source)] if Path(source).is_file() else Path(source).rglob("*")
    return sorted([str(p), p.stat().st_size, p.stat().st_mtime_ns] for p in files if p.is_file())


def _read(path: Path) -> str | None:
    return path.read_text() if path.is_file() else None


def train_command(recipe: list[str], data: Path, run: Path, threads: int, nproc: int,
                  eval_every: int, seed: int = 0) -> list[str]:
    """`ddpgpt train` for one recipe, seeded `seed` (module docstring), its val loss evaluated on
    every val window every `eval_every` steps; 16 sequences a step unless the recipe says
    otherwise (its flags come last)."""
    return [sys.executable, "-m", "ddpgpt", "train", "--data", str(data), "--run-dir", str(run),
            "--device", "cpu", "--data.global-batch", "16",
            "--data.micro-batch", str(16 // nproc), "--nproc", str(nproc),
            "--run.threads", str(max(1, threads // nproc)), "--data.eval-windows", "0",
            "--data.train-eval-windows", "0", "--run.eval-every", str(eval_every),
            "--run.checkpoint-every", "0",
            "--run.seed", str(1337 + seed), "--data.seed", str(1337 + seed), *recipe]


def ddpgpt(recipe: list[str], data: Path, run: Path, threads: int, nproc: int,
           eval_every: int, seed: int = 0) -> dict:
    """One ddpgpt recipe trained to its end (train_command); its evaluations and totals. Where
    `run` already finished the same resolved config (`ddpgpt train --print-config`), it is
    read, not trained again."""
    cmd = train_command(recipe, data, run, threads, nproc, eval_every, seed)
    config = subprocess.run([*cmd, "--print-config"], capture_output=True, text=True, check=True)
    stamp = run / "resolved.toml"
    if stamp.is_file() and _settings(stamp.read_text()) == _settings(config.stdout):
        try:
            return read_run(run)
        except (OSError, IndexError, KeyError, ValueError):
            pass  # unfinished: train it again
    if run.exists():
        shutil.rmtree(run)
    print("$", " ".join(cmd[1:]), flush=True)
    before = load()
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"speedrun: ddpgpt train failed (exit {done.returncode}):\n"
                         f"{done.stderr[-2000:]}")
    (run / "load.json").write_text(json.dumps([before, load()]))
    stamp.write_text(config.stdout)
    return read_run(run)


def _settings(toml: str) -> list[str]:
    """A resolved config's settings: its lines but the comments (the header says whether the
    run would start from scratch or resume, which a finished run's directory changes)."""
    return [line for line in toml.splitlines() if not line.startswith("#")]


def load() -> float:
    """The machine's 1-minute load average (`uptime`'s first figure)."""
    return os.getloadavg()[0]


def read_run(run: Path) -> dict:
    """A finished run's evaluations (step, val loss, training seconds) and its totals."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "val_loss" in r and "event" not in r]
    last = evals[-1]
    loads = json.loads(_read(run / "load.json") or "[]")
    return {"evals": [(r["step"], r["val_loss"], r["train_s"]) for r in evals], "load": loads,
            "steps": last["step"], "final_val": last["val_loss"], "train_s": last["train_s"],
            "step_s": last["train_s"] / last["step"],
            "tokens_per_s": last["step"] * _tokens_per_step(run) / last["train_s"]}


def _tokens_per_step(run: Path) -> int:
    cfg = json.loads((run / "config.json").read_text())
    return cfg["data"]["global_batch"] * cfg["data"]["seq_len"]


def nanogpt_run(snapshot: Path, data: Path, run: Path, threads: int, seed: int) -> dict:
    """nanoGPT's run (benchmarks/nanogpt.py) scored by ddpgpt's evaluator: its training seconds,
    final val loss and the load at its start and end; read, not trained again, where `run` holds
    a finished run of the same stamp (nanoGPT's files, flags, seed, threads and tokens)."""
    stamp, result = nanogpt.stamp(snapshot, data, threads, seed), run / "result.json"
    if _read(run / "stamp.json") == stamp and result.is_file():
        return json.loads(result.read_text())
    before = load()
    out = nanogpt.train(snapshot, data, run, threads, seed)
    out["load"] = [before, load()]
    out["final_val"] = nanogpt.score(snapshot, out.pop("checkpoint"), data, threads)
    del out["times"]
    result.write_text(json.dumps(out))
    (run / "stamp.json").write_text(stamp)
    return out


def pace(snapshot: Path | None, recipes: list[str], data: Path, work: Path, args) -> dict:
    """Seconds per step measured apart from the full runs: `args.pace` rounds, each a
    PACE_STEPS-step run of nanoGPT and then of every recipe, taking turns so that both see the
    same load. A run's figure is the median of its steps after the first PACE_SKIP (warmup and
    nanoGPT's evaluation at step 0), with the load at its start and end. Recorded in
    WORK/pace.json; with `args.pace` 0, the figures recorded there at the same thread count."""
    record = work / "pace.json"
    if not args.pace:
        saved = json.loads(_read(record) or "{}")
        return saved.get("rounds", {}) if saved.get("threads") == args.threads else {}
    out = {name: [] for name in (["nanogpt"] if snapshot is not None else []) + recipes}
    for _ in range(args.pace):
        if snapshot is not None:
            before = load()
            run = nanogpt.train(snapshot, data, work / "pace" / "nanogpt", args.threads,
                                steps=PACE_STEPS)
            out["nanogpt"].append({"step_s": statistics.median(run["times"][PACE_SKIP:]),
                                   "load": [before, load()]})
        for name in recipes:
            run = work / "pace" / name
            if run.exists():
                shutil.rmtree(run)
            cmd = [*train_command([*RECIPES[name], "--run.steps", str(PACE_STEPS)], data, run,
                                  args.threads, args.nproc, 0), "--data.eval-windows", "1"]
            before = load()
            subprocess.run(cmd, capture_output=True, text=True, check=True)
            out[name].append({"step_s": statistics.median(step_seconds(run)[PACE_SKIP:]),
                              "load": [before, load()]})
    work.mkdir(parents=True, exist_ok=True)
    record.write_text(json.dumps({"threads": args.threads, "rounds": out}, indent=1))
    return out


def step_seconds(run: Path) -> list[float]:
    """Each training step's seconds, from metrics.jsonl's per-step tokens/s."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    per_step = _tokens_per_step(run)
    return [per_step / r["tokens_per_s"] for r in rows
            if "tokens_per_s" in r and "val_loss" not in r and "event" not in r]


def to_target(evals: list[tuple[int, float, float]], target: float) -> tuple[int, float] | None:
    """(step, training seconds) of the first evaluation at or below `target`."""
    return next(((step, s) for step, loss, s in evals if loss <= target), None)


def spread(values: list[float], fmt: str) -> str:
    """The mean, and the range (min–max) when there are several."""
    if not values:
        return "–"
    mean = format(statistics.fmean(values), fmt)
    if len(values) == 1:
        return mean
    return f"{mean} ({format(min(values), fmt)}–{format(max(values), fmt)})"


def _load(runs: list[dict]) -> str:
    """The load over runs: each run's mean of its start and end, then spread; – if unrecorded."""
    return spread([statistics.fmean(r["load"]) for r in runs if r.get("load")], ".1f")


def table(corpus: str, args, target: float | None, ng_runs: list[dict],
          results: dict[str, list[dict]], paced: dict) -> tuple[list[str], dict]:
    """The Markdown table of the runs and the summary written beside it. `× nanoGPT's time`
    pairs each seed's time to target with the nanoGPT run it took turns with; the paced one is
    steps to target × the recipe's s/step over 500 × nanoGPT's, both s/step from `paced` (the
    median over its rounds of the recipe's s/step over nanoGPT's in the same round)."""
    lines = [f"\ncorpus {corpus}, {args.threads} threads, ddpgpt on {args.nproc} process(es), "
             f"{len(ng_runs) or len(next(iter(results.values()), []))} seed(s), mean (min–max); "
             "target val loss " + (f"{target:.4f}" if target is not None else "none"),
             "| run | steps to target | s/step | training s to target | × nanoGPT's time | "
             "load | paced s/step | × nanoGPT's time, paced | final val loss (step) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    ng_pace = [r["step_s"] for r in paced.get("nanogpt", [])]
    if ng_runs:
        lines.append(f"| nanoGPT | {nanogpt.STEPS} | "
                     f"{spread([r['train_s'] / nanogpt.STEPS for r in ng_runs], '.3f')} | "
                     f"{spread([r['train_s'] for r in ng_runs], '.1f')} | 1 | {_load(ng_runs)} | "
                     f"{spread(ng_pace, '.3f')} | 1 | "
                     f"{spread([r['final_val'] for r in ng_runs], '.4f')} ({nanogpt.STEPS}) |")
    summary = {"corpus": corpus, "target": target, "nanogpt": ng_runs, "paced": paced,
               "recipes": {}}
    for name, outs in results.items():
        if not outs:
            continue
        hits = [to_target(o["evals"], target) for o in outs] if target is not None else []
        hit = [h for h in hits if h is not None]
        # each seed against the nanoGPT run it took turns with (the machine's load reaches both)
        ratio = [h[1] / ng["train_s"] for h, ng in zip(hits, ng_runs) if h is not None]
        own = [r["step_s"] for r in paced.get(name, [])]
        per_step = (statistics.median(a / b for a, b in zip(own, ng_pace))
                    if own and ng_pace else None)
        paced_ratio = ([step * per_step / nanogpt.STEPS for step, _ in hit]
                       if per_step is not None else [])
        reached = (spread([float(step) for step, _ in hit], '.0f') if hit else "not reached")
        if hit and len(hit) < len(hits):
            reached += f" ({len(hits) - len(hit)} of {len(hits)} seeds not)"
        lines.append(f"| ddpgpt {name} | {reached} | "
                     f"{spread([o['step_s'] for o in outs], '.3f')} | "
                     f"{spread([s for _, s in hit], '.1f')} | {spread(ratio, '.2f')} | "
                     f"{_load(outs)} | {spread(own, '.3f')} | {spread(paced_ratio, '.2f')} | "
                     f"{spread([o['final_val'] for o in outs], '.4f')} ({outs[0]['steps']}) |")
        summary["recipes"][name] = {"runs": outs, "to_target": hits, "ratio": ratio,
                                    "paced_ratio": paced_ratio}
    if paced:
        rounds = max(len(r) for r in paced.values())
        lines.append(f"\npaced: {rounds} round(s) of {PACE_STEPS} steps each side, taking "
                     f"turns, load {_load([r for rs in paced.values() for r in rs])}")
    return lines, summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nanogpt", default=os.environ.get("NANOGPT"),
                        help="a nanoGPT checkout (train.py, model.py, configurator.py)")
    parser.add_argument("--target", type=float, default=None,
                        help="the val loss to reach, instead of nanoGPT's full runs' mean (with "
                        "--nanogpt, nanoGPT then runs for --pace alone)")
    parser.add_argument("--corpus", default="bytes",
                        help="bytes, bpe, prose, perl, a prepared dataset dir or a dir of text")
    parser.add_argument("--tokenizer", default="bpe", choices=("bpe", "byte"),
                        help="how a directory of text is prepared")
    parser.add_argument("--recipes", default=DEFAULT_RECIPES,
                        help=f"comma-separated, of {', '.join(RECIPES)}")
    parser.add_argument("--nproc", type=int, default=1, help="ddpgpt's processes")
    parser.add_argument("--threads", type=int, default=2, help="threads in all, for each side")
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--seeds", type=int, default=1,
                        help="seeds 0 .. N-1, each a full round (0: none, --pace alone)")
    parser.add_argument("--pace", type=int, default=0,
                        help=f"rounds of {PACE_STEPS}-step runs timing each side's s/step, "
                        "taking turns, after the full runs (0: the last ones recorded)")
    parser.add_argument("--work", default="bench/speedrun")
    args = parser.parse_args()
    recipes = [r for r in args.recipes.split(",") if r]
    unknown = [r for r in recipes if r not in RECIPES]
    if unknown:
        raise SystemExit(f"speedrun: unknown recipe {unknown[0]!r}; choose from "
                         f"{', '.join(RECIPES)}")
    if args.seeds < 0:
        raise SystemExit(f"speedrun: --seeds {args.seeds} must be at least 0 (0: --pace alone)")
    snapshot = Path(args.nanogpt).expanduser() if args.nanogpt else None
    if snapshot is not None:
        nanogpt.check(snapshot)
    else:
        print("speedrun: nanoGPT skipped (pass --nanogpt DIR, a clone of "
              "github.com/karpathy/nanoGPT, or set NANOGPT)", flush=True)
    work = Path(args.work)
    corpus, data = prepare(args.corpus, work, args.tokenizer)
    ng_runs, results = [], {r: [] for r in recipes}
    for seed in range(args.seeds):
        base = work / corpus / str(seed)
        if snapshot is not None and args.target is None:
            run = nanogpt_run(snapshot, data, base / "nanogpt", args.threads, seed)
            ng_runs.append(run)
            print(f"nanoGPT seed {seed}: val {run['final_val']:.4f} after {run['train_s']:.1f} s",
                  flush=True)
        for name in recipes:
            out = ddpgpt(RECIPES[name], data, base / name, args.threads, args.nproc,
                         args.eval_every, seed)
            results[name].append(out)
            print(f"{name} seed {seed}: val {out['final_val']:.4f} at step {out['steps']} after "
                  f"{out['train_s']:.1f} s", flush=True)
    target = statistics.fmean(r["final_val"] for r in ng_runs) if ng_runs else args.target
    paced = pace(snapshot, recipes, data, work / corpus, args)
    lines, summary = table(corpus, args, target, ng_runs, results, paced)
    print("\n".join(lines))
    path = work / f"{corpus}.json"
    path.write_text(json.dumps(summary, indent=1, default=str))
    print(f"\nwritten: {path}")


if __name__ == "__main__":
    main()

"""Time to a validation loss, side by side with nanoGPT: the speedrun measure on this machine.

    python -m benchmarks.speedrun --nanogpt ~/src/nanoGPT            # the stdlib's bytes
    python -m benchmarks.speedrun --nanogpt ~/src/nanoGPT --corpus bpe --recipes muon,speedrun
    python -m benchmarks.speedrun --target 1.9362                     # no nanoGPT: a given target

nanoGPT (a clone of github.com/karpathy/nanoGPT, passed by path and run unmodified) trains its
own `train.py` on the corpus's tokens: 4 layers × 256 wide, T=256, 16 sequences a step, AdamW at
lr 1e-3 → 1e-4 (cosine, warmup 50), 500 steps, fp32, `--threads` threads. Its checkpoint is then
scored by ddpgpt's evaluator (`ddpgpt.evals.loss.evaluate`) on every val window ddpgpt evaluates,
so its final val loss and ddpgpt's come from one evaluator; that loss is the target. Each ddpgpt
recipe trains on the same prepared tokens and is evaluated on the same windows every
`--eval-every` steps; its time to target is the training seconds (`train_s`: evaluations and
checkpoints apart) at the first evaluation at or below the target, so it is an upper bound by up
to `--eval-every` steps.

nanoGPT's training seconds are the sum of its logged step times over its 500 steps; its first
step's time holds its one-batch evaluation at step 0 (`--eval_iters=1`, ~0.1 s). Without a
snapshot (no `--nanogpt`, no $NANOGPT) it is skipped with one line, and `--target` (if given)
stands in for its loss.

`--repeats N` runs everything N times, nanoGPT and the recipes taking turns, and reports the
median and the range. Runs go into WORK/<corpus>/<repeat>/; the table is printed as Markdown
and written with every figure to WORK/<corpus>.json. docs/performance.md ("Time to a loss")
holds the results.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pickle
import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

# nanoGPT's run: the tiny preset's model and batch, its own AdamW defaults (wd 0.1, betas
# 0.9/0.95, clip 1.0), no dropout, no biases.
NANOGPT_FLAGS = ["--batch_size=16", "--block_size=256", "--gradient_accumulation_steps=1",
                 "--n_layer=4", "--n_head=4", "--n_embd=256", "--dropout=0.0", "--bias=False",
                 "--learning_rate=1e-3", "--min_lr=1e-4", "--warmup_iters=50",
                 "--max_iters=500", "--lr_decay_iters=500", "--device=cpu", "--dtype=float32",
                 "--compile=False", "--eval_interval=500", "--eval_iters=1",
                 "--always_save_checkpoint=True"]
NANOGPT_STEPS = 500
NANOGPT_FILES = ("train.py", "model.py", "configurator.py")

# Every recipe: 16 sequences of 256 tokens a step, the tiny preset's 4 × 256 model, on
# --nproc processes.
RECIPES = {
    # nanoGPT's model (no biases, exact GELU), optimizer and schedule, exactly
    "adamw": ["--preset", "tiny", "--model.bias", "false", "--model.gelu", "exact",
              "--optim.name", "adamw", "--optim.lr", "1e-3", "--optim.min-lr", "1e-4",
              "--optim.warmup-steps", "50", "--run.steps", "500"],
    # the tiny preset's Muon, as the demo trained before the speedrun
    "muon": ["--preset", "tiny", "--optim.name", "muon", "--run.steps", "500"],
    # the `speedrun` preset (docs/performance.md, "Time to a loss")
    "speedrun": ["--preset", "speedrun"],
    # the same for as many steps as the others: its final quality at equal steps
    "speedrun-500": ["--preset", "speedrun", "--run.steps", "500"],
    # the tiny preset's Muon on the modern architecture (docs/model.md): SwiGLU, and ReLU²
    "modern": ["--preset", "tiny", "--optim.name", "muon", "--model.arch", "modern",
               "--run.steps", "500"],
    "modern-relu2": ["--preset", "tiny", "--optim.name", "muon", "--model.arch", "modern",
                     "--model.mlp", "relu2", "--run.steps", "500"],
}
DEFAULT_RECIPES = "adamw,muon,speedrun"


def prepare(corpus: str, work: Path) -> Path:
    """The stdlib corpus as byte tokens or bpe-4096 tokens (prepared once)."""
    out = work / f"data-{corpus}"
    if not (out / "meta.json").is_file():
        tokenizer = {"bytes": "byte", "bpe": "bpe"}[corpus]
        subprocess.run([sys.executable, "-m", "ddpgpt", "prepare", "--tokenizer", tokenizer,
                        "--out", str(out)], check=True)
    return out


def nanogpt(snapshot: Path, data: Path, run: Path, threads: int) -> dict:
    """nanoGPT's train.py on the prepared tokens; its training seconds and checkpoint."""
    from ddpgpt.data.shards import TokenDataset, open_shard
    if run.exists():
        shutil.rmtree(run)
    (run / "data" / "corpus").mkdir(parents=True)
    for name in NANOGPT_FILES:
        shutil.copy(snapshot / name, run / name)
    dataset = TokenDataset(data)
    for split in ("train", "val"):
        with open(run / "data" / "corpus" / f"{split}.bin", "wb") as f:
            for info in dataset.shards[split]:
                tokens = open_shard(data / info.file)
                if tokens.dtype.itemsize != 2:
                    raise SystemExit("speedrun: nanoGPT reads uint16 tokens; this corpus has "
                                     f"{tokens.dtype}")
                tokens.tofile(f)
    with open(run / "data" / "corpus" / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": dataset.vocab_size}, f)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    print(f"$ (cd {run} && python train.py --dataset=corpus ...)", flush=True)
    log = subprocess.run([sys.executable, "train.py", "--dataset=corpus", "--out_dir=out",
                          *NANOGPT_FLAGS], cwd=run, env=env, capture_output=True, text=True)
    (run / "train.log").write_text(log.stdout + log.stderr)
    if log.returncode != 0:
        raise SystemExit(f"speedrun: nanoGPT failed (exit {log.returncode}); its output is in "
                         f"{run / 'train.log'}")
    steps = step_seconds(log.stdout, NANOGPT_STEPS)
    train_s = sum(steps)
    return {"train_s": train_s, "step_s": statistics.median(steps),
            "tokens_per_s": NANOGPT_STEPS * 16 * 256 / train_s,
            "checkpoint": run / "out" / "ckpt.pt"}


def step_seconds(log: str, steps: int) -> list[float]:
    """Each step's seconds from nanoGPT's log lines `iter N: loss L, time Tms, mfu M%`, for steps
    0 .. steps - 1."""
    times = {int(m.group(1)): float(m.group(2)) / 1000 for m in
             re.finditer(r"^iter (\d+): loss \S+, time ([\d.]+)ms", log, re.M)}
    missing = [i for i in range(steps) if i not in times]
    if missing:
        raise SystemExit(f"speedrun: nanoGPT's log has no time for step {missing[0]}")
    return [times[i] for i in range(steps)]


def score_nanogpt(snapshot: Path, checkpoint: Path, data: Path, threads: int) -> float:
    """nanoGPT's checkpoint through ddpgpt's evaluator on every val window."""
    import torch
    import torch.nn.functional as F

    from ddpgpt.data.loader import EvalLoader
    from ddpgpt.data.shards import TokenDataset
    from ddpgpt.distributed.group import DistEnv
    from ddpgpt.evals.loss import evaluate

    spec = importlib.util.spec_from_file_location("nanogpt_model", snapshot / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    saved = torch.load(checkpoint, map_location="cpu", weights_only=False)
    model = module.GPT(module.GPTConfig(**saved["model_args"]))
    model.load_state_dict({k.removeprefix("_orig_mod."): v for k, v in saved["model"].items()})

    class Scored(torch.nn.Module):
        """nanoGPT's model with the forward ddpgpt's evaluator calls: (logits, loss summed or
        averaged over the targets that are not -1)."""

        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x, y, reduction="mean"):
            logits, _ = self.inner(x, y.contiguous())  # with targets: logits at every position
            return logits, F.cross_entropy(logits.flatten(0, 1).float(), y.reshape(-1),
                                           ignore_index=-1, reduction=reduction)

    torch.set_num_threads(threads)
    loader = EvalLoader(TokenDataset(data), seq_len=saved["model_args"]["block_size"],
                        micro_batch=16)
    return evaluate(Scored(model), loader, DistEnv())


def ddpgpt(recipe: list[str], data: Path, run: Path, threads: int, nproc: int,
           eval_every: int) -> dict:
    """One ddpgpt recipe to its end, evaluated on every val window every `eval_every` steps."""
    if run.exists():
        shutil.rmtree(run)
    cmd = [sys.executable, "-m", "ddpgpt", "train", "--data", str(data), "--run-dir", str(run),
           "--device", "cpu", *recipe, "--data.global-batch", "16",
           "--data.micro-batch", str(16 // nproc), "--nproc", str(nproc),
           "--run.threads", str(max(1, threads // nproc)), "--data.eval-windows", "0",
           "--run.eval-every", str(eval_every), "--run.checkpoint-every", "0"]
    print("$", " ".join(cmd[1:]), flush=True)
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"speedrun: ddpgpt train failed (exit {done.returncode}):\n"
                         f"{done.stderr[-2000:]}")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "val_loss" in r and "event" not in r]
    last = evals[-1]
    return {"evals": [(r["step"], r["val_loss"], r["train_s"]) for r in evals],
            "steps": last["step"], "final_val": last["val_loss"], "train_s": last["train_s"],
            "tokens_per_s": last["step"] * _tokens_per_step(run) / last["train_s"]}


def _tokens_per_step(run: Path) -> int:
    cfg = json.loads((run / "config.json").read_text())
    return cfg["data"]["global_batch"] * cfg["data"]["seq_len"]


def to_target(evals: list[tuple[int, float, float]], target: float) -> tuple[int, float] | None:
    """(step, training seconds) of the first evaluation at or below `target`."""
    return next(((step, s) for step, loss, s in evals if loss <= target), None)


def spread(values: list[float], fmt: str) -> str:
    """The median, and the range when there are several."""
    if not values:
        return "–"
    mid = format(statistics.median(values), fmt)
    if len(values) == 1:
        return mid
    return f"{mid} ({format(min(values), fmt)}–{format(max(values), fmt)})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nanogpt", default=os.environ.get("NANOGPT"),
                        help="a nanoGPT checkout (train.py, model.py, configurator.py)")
    parser.add_argument("--target", type=float, default=None,
                        help="the val loss to reach when nanoGPT is not run")
    parser.add_argument("--corpus", choices=("bytes", "bpe"), default="bytes")
    parser.add_argument("--recipes", default=DEFAULT_RECIPES,
                        help=f"comma-separated, of {', '.join(RECIPES)}")
    parser.add_argument("--nproc", type=int, default=1, help="ddpgpt's processes")
    parser.add_argument("--threads", type=int, default=2, help="threads in all, for each side")
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--work", default="bench/speedrun")
    args = parser.parse_args()
    recipes = [r for r in args.recipes.split(",") if r]
    unknown = [r for r in recipes if r not in RECIPES]
    if unknown:
        raise SystemExit(f"speedrun: unknown recipe {unknown[0]!r}; choose from "
                         f"{', '.join(RECIPES)}")
    snapshot = Path(args.nanogpt).expanduser() if args.nanogpt else None
    if snapshot is not None and not all((snapshot / f).is_file() for f in NANOGPT_FILES):
        raise SystemExit(f"speedrun: {snapshot} is not a nanoGPT checkout (no "
                         f"{', '.join(NANOGPT_FILES)}); clone github.com/karpathy/nanoGPT")
    if snapshot is None:
        print("speedrun: nanoGPT skipped (pass --nanogpt DIR, a clone of "
              "github.com/karpathy/nanoGPT, or set NANOGPT)", flush=True)
    work = Path(args.work)
    data = prepare(args.corpus, work)
    ng_runs, results = [], {r: [] for r in recipes}
    for rep in range(args.repeats):
        base = work / args.corpus / str(rep)
        if snapshot is not None:
            run = nanogpt(snapshot, data, base / "nanogpt", args.threads)
            run["final_val"] = score_nanogpt(snapshot, run.pop("checkpoint"), data, args.threads)
            ng_runs.append(run)
            print(f"nanoGPT: val {run['final_val']:.4f} after {run['train_s']:.1f} s", flush=True)
        for name in recipes:
            out = ddpgpt(RECIPES[name], data, base / name, args.threads, args.nproc,
                         args.eval_every)
            results[name].append(out)
            print(f"{name}: val {out['final_val']:.4f} at step {out['steps']} after "
                  f"{out['train_s']:.1f} s", flush=True)
    target = (statistics.median(r["final_val"] for r in ng_runs) if ng_runs else args.target)
    table = [f"\ncorpus {args.corpus}, {args.threads} threads, ddpgpt on {args.nproc} "
             f"process(es), {args.repeats} repeat(s); target val loss "
             + (f"{target:.4f}" if target is not None else "none"),
             "| run | steps to target | training s to target | × nanoGPT's time | tokens/s | "
             "final val loss (step) |", "|---|---:|---:|---:|---:|---:|"]
    if ng_runs:
        table.append(f"| nanoGPT | {NANOGPT_STEPS} | "
                     f"{spread([r['train_s'] for r in ng_runs], '.1f')} | 1 | "
                     f"{spread([r['tokens_per_s'] for r in ng_runs], ',.0f')} | "
                     f"{spread([r['final_val'] for r in ng_runs], '.4f')} ({NANOGPT_STEPS}) |")
    summary = {"target": target, "nanogpt": ng_runs, "recipes": {}}
    for name, outs in results.items():
        hits = [to_target(o["evals"], target) for o in outs] if target is not None else []
        hit = [h for h in hits if h is not None]
        # each repeat against the nanoGPT run it took turns with (the machine's drift reaches both)
        ratio = [h[1] / ng["train_s"] for h, ng in zip(hits, ng_runs) if h is not None]
        reached = spread([float(step) for step, _ in hit], '.0f') if hit else "not reached"
        table.append(f"| ddpgpt {name} | {reached} | {spread([s for _, s in hit], '.1f')} | "
                     f"{spread(ratio, '.2f')} | {spread([o['tokens_per_s'] for o in outs], ',.0f')}"
                     f" | {spread([o['final_val'] for o in outs], '.4f')} ({outs[0]['steps']}) |")
        summary["recipes"][name] = {"runs": outs, "to_target": hits, "ratio": ratio}
    print("\n".join(table))
    path = work / f"{args.corpus}.json"
    path.write_text(json.dumps(summary, indent=1, default=str))
    print(f"\nwritten: {path}")


if __name__ == "__main__":
    main()

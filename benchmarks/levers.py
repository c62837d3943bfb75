"""The speedrun recipe's levers, one at a time: each a change to one base recipe, trained on a
corpus with several seeds, against the base at equal steps.

    python -m benchmarks.levers --corpus bpe --seeds 2                    # every lever
    python -m benchmarks.levers --corpus prose --levers base,no-rope,relu2 --target 4.25
    python -m benchmarks.levers --corpus bpe --levers muon-eq,muon-eq+muon-snap   # a+b: both

The figures depend neither on the machine's load nor on its speed (a config gives the same losses
on every run at one thread count on one process): the val loss at every evaluation (all val
windows, every --eval-every steps), the final one's difference from the base's of the same seed
(mean and range over the seeds: a lever helps only where the whole range is below 0), and the
steps to a target val loss (--target, or else the nanoGPT target in WORK/<corpus>.json that
benchmarks/speedrun.py wrote). Time per step is measured apart (benchmarks/speedrun.py's s/step),
since on a shared machine it moves with the load.

Seeds and the corpus are as in benchmarks/speedrun.py. A run whose directory already holds a
finished run of the same config (as `ddpgpt train --print-config` resolves it) is read, not
trained again, so seeds and levers can be added
later; runs go into WORK/levers/<corpus>/<lever>/<seed>/ and the table to WORK/levers-<corpus>.md.
With --upto N every run stops after as many tokens as N steps of 16 sequences (a screen up to
where the base crosses the target: the losses up to there are the whole run's, its schedule
unchanged), the table's marks and final val then at its last step.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks import speedrun
from ddpgpt.config.presets import get_preset

# The base: the speedrun preset as it is (docs/performance.md's "Time to a loss").
BASE = ["--preset", "speedrun"]
LEVERS = {
    "base": [],
    # deliverable 4's reference: the tiny preset's Muon on GPT-2's model, as long as the base
    "tiny-muon": ["--preset", "tiny", "--model.arch", "gpt2", "--optim.name", "muon"],
    # the architecture, piece by piece
    "gpt2": ["--model.arch", "gpt2", "--model.gelu", "exact"],
    "no-rope": ["--model.rope", "false"],
    "layernorm": ["--model.norm", "layernorm"],
    "no-qk-norm": ["--model.qk-norm", "false"],
    "swiglu": ["--model.mlp", "swiglu"],
    "relu2": ["--model.mlp", "relu2"],
    "gelu": ["--model.mlp", "gelu", "--model.gelu", "exact"],
    "tied": ["--model.tie-embeddings", "true"],
    "no-zero-init": ["--model.zero-init-proj", "false"],
    "bias": ["--model.bias", "true"],
    "softcap-15": ["--model.logit-softcap", "15"],
    "softcap-30": ["--model.logit-softcap", "30"],
    # the shape: cheaper steps (the time to a loss is steps × a step's cost)
    "layers-3": ["--model.n-layer", "3"],
    "layers-5": ["--model.n-layer", "5"],
    "kv-2": ["--model.n-kv-head", "2"],
    "mlp-512": ["--model.mlp-hidden", "512"],
    # the lr split: AdamW's lr (embedding, head, gains) against Muon's
    "adamw-lr-1e-3": ["--optim.lr", "1e-3", "--optim.min-lr", "1e-4"],
    "adamw-lr-2e-3": ["--optim.lr", "2e-3", "--optim.min-lr", "2e-4"],
    "adamw-lr-4e-3": ["--optim.lr", "4e-3", "--optim.min-lr", "4e-4"],
    "adamw-lr-6e-3": ["--optim.lr", "6e-3", "--optim.min-lr", "6e-4"],
    "adamw-lr-8e-3": ["--optim.lr", "8e-3", "--optim.min-lr", "8e-4"],
    "embed-lr-off": ["--optim.embed-lr", "0"],  # the embedding at optim.lr, as the head
    "embed-lr-0.02": ["--optim.embed-lr", "0.02"],
    "embed-lr-0.04": ["--optim.embed-lr", "0.04"],
    "embed-lr-0.2": ["--optim.embed-lr", "0.2"],
    "embed-lr-0.4": ["--optim.embed-lr", "0.4"],
    "muon-lr-0.03": ["--optim.muon-lr", "0.03"],
    "muon-lr-0.015": ["--optim.muon-lr", "0.015"],
    "muon-lr-0.025": ["--optim.muon-lr", "0.025"],
    # Muon's orthogonalizer: Polar Express's polynomials instead of the quintic's
    "polar": ["--optim.muon-ns", "polar"],
    # Muon's update around the orthogonalizer: MuonEq-R's rows, the norm snapped after it
    "muon-eq": ["--optim.muon-eq", "true"],
    "muon-snap": ["--optim.muon-snap", "true"],
    "muon-eq-snap": ["--optim.muon-eq", "true", "--optim.muon-snap", "true"],
    # Muon's momentum and its warmup
    "momentum-flat": ["--optim.muon-momentum-warmup", "0"],
    "momentum-0.9": ["--optim.muon-momentum", "0.9"],
    "momentum-50": ["--optim.muon-momentum-warmup", "50"],
    # the schedule's shape and its length
    "wsd-0.2": ["--optim.schedule", "wsd", "--optim.decay-fraction", "0.2"],
    "wsd-0.4": ["--optim.schedule", "wsd", "--optim.decay-fraction", "0.4"],
    "wsd-0.6": ["--optim.schedule", "wsd", "--optim.decay-fraction", "0.6"],
    "min-lr-0": ["--optim.min-lr", "0"],
    "steps-150": ["--run.steps", "150"],
    "steps-175": ["--run.steps", "175"],
    "steps-250": ["--run.steps", "250"],
    "warmup-0": ["--optim.warmup-steps", "0"],
    "warmup-10": ["--optim.warmup-steps", "10"],
    "warmup-5": ["--optim.warmup-steps", "5"],
    # the batch in tokens: 8 sequences a step for as many tokens (twice the steps, warmups and
    # evaluations spaced as far apart in tokens)
    "batch-8": ["--data.global-batch", "8", "--data.micro-batch", "8", "--run.steps", "400",
                "--optim.warmup-steps", "40", "--optim.muon-momentum-warmup", "200",
                "--run.eval-every", "50"],
    # 32 sequences a step for as many tokens (half the steps, warmups and evaluations as near)
    "batch-32": ["--data.global-batch", "32", "--data.micro-batch", "32", "--run.steps", "100",
                 "--optim.warmup-steps", "10", "--optim.muon-momentum-warmup", "50",
                 "--run.eval-every", "5"],
}


def flags(name: str) -> list[str]:
    """A lever's flags; `a+b` is levers a and b together."""
    return [flag for part in name.split("+") for flag in LEVERS[part]]


def last(recipe: list[str], flag: str, default: str) -> str:
    """The value the last `flag` of `recipe` gives, or `default`."""
    at = [i for i, f in enumerate(recipe) if f == flag]
    return recipe[at[-1] + 1] if at else default


def cut(recipe: list[str], upto: int) -> list[str]:
    """`recipe` stopped after the steps that hold as many tokens as `upto` steps of 16
    sequences, on the schedule it has over its whole run (optim.decay-steps: the losses up to
    there are the whole run's)."""
    preset = get_preset("speedrun")
    steps = last(recipe, "--run.steps", str(preset.run.steps))
    batch = int(last(recipe, "--data.global-batch", str(preset.data.global_batch)))
    return [*recipe, "--optim.decay-steps", steps, "--run.steps", str(upto * 16 // batch)]


def run_lever(name: str, data: Path, run: Path, seed: int, args) -> dict:
    """One lever's run for one seed (to --upto's step, where given), trained or, when `run`
    finished the same resolved config, read (benchmarks/speedrun.py's ddpgpt)."""
    recipe = [*BASE, *flags(name)]
    return speedrun.ddpgpt(cut(recipe, args.upto) if args.upto else recipe, data, run,
                           args.threads, 1, args.eval_every, seed)


def loss_at(out: dict, step: int) -> float | None:
    return next((loss for s, loss, _ in out["evals"] if s == step), None)


def table(corpus: str, target: float | None, runs: dict[str, list[dict]]) -> list[str]:
    """Markdown: each lever's val loss at a quarter, half and all of the base's steps, its final
    loss's difference from the base's (seed by seed), and its steps to the target."""
    base = runs["base"]
    end = base[0]["steps"]
    marks = sorted({end // 4 // 25 * 25 or 25, end // 2 // 25 * 25 or 25, end})
    lines = [f"\ncorpus {corpus}; {len(base)} seed(s): mean (min–max); target "
             + (f"{target:.4f}" if target is not None else "none"),
             "| lever | " + " | ".join(f"val at {m}" for m in marks)
             + " | final val (step) | final − base's | steps to target |",
             "|---|" + "---:|" * (len(marks) + 3)]
    for name, outs in runs.items():
        vals = [" " + speedrun.spread([v for o in outs if (v := loss_at(o, m)) is not None],
                                      ".4f") for m in marks]
        delta = [o["final_val"] - b["final_val"] for o, b in zip(outs, base)]
        hits = [speedrun.to_target(o["evals"], target) for o in outs] if target else []
        steps = [float(h[0]) for h in hits if h is not None]
        reach = speedrun.spread(steps, ".0f") if steps else ("–" if not hits else "not reached")
        if steps and len(steps) < len(hits):
            reach += f" ({len(hits) - len(steps)} not)"
        lines.append(f"| {name} |" + " |".join(vals)
                     + f" | {speedrun.spread([o['final_val'] for o in outs], '.4f')} "
                     f"({outs[0]['steps']}) | {speedrun.spread(delta, '+.4f')} | {reach} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", default="bytes",
                        help="bytes, bpe, prose, perl, a prepared dataset dir or a dir of text")
    parser.add_argument("--tokenizer", default="bpe", choices=("bpe", "byte"))
    parser.add_argument("--levers", default=",".join(LEVERS),
                        help=f"comma-separated, of {', '.join(LEVERS)}")
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--target", type=float, default=None)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--upto", type=int, default=0,
                        help="stop every run after this many steps of 16 sequences (a lever's "
                             "own batch: as many tokens), on its whole run's schedule")
    parser.add_argument("--work", default="bench/speedrun")
    args = parser.parse_args()
    names = ["base"] + [n for n in args.levers.split(",") if n and n != "base"]
    unknown = [part for n in names for part in n.split("+") if part not in LEVERS]
    if unknown:
        raise SystemExit(f"levers: unknown lever {unknown[0]!r}; choose from {', '.join(LEVERS)}")
    work = Path(args.work)
    corpus, data = speedrun.prepare(args.corpus, work, args.tokenizer)
    target = args.target
    if target is None and (work / f"{corpus}.json").is_file():
        target = json.loads((work / f"{corpus}.json").read_text()).get("target")
    runs = {name: [] for name in names}
    for seed in range(args.seeds):
        for name in names:
            run = work / "levers" / corpus / name / (f"{seed}-to{args.upto}" if args.upto
                                                      else str(seed))
            out = run_lever(name, data, run, seed, args)
            runs[name].append(out)
            print(f"{name} seed {seed}: val {out['final_val']:.4f} at step {out['steps']}",
                  flush=True)
    lines = table(corpus, target, runs)
    print("\n".join(lines))
    (work / f"levers-{corpus}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

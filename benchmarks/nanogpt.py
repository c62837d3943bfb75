"""nanoGPT's side of the speedrun benchmark: its unmodified `train.py` on a prepared dataset's
tokens, its step times from its log, and its checkpoint scored by ddpgpt's evaluator.

nanoGPT seeds everything (its init and the batches its `get_batch` draws) with
`torch.manual_seed(1337 + seed_offset)`, where `seed_offset` is the DDP rank and not a setting.
Seed k is given without touching its files: its configurator executes a config file named on the
command line inside train.py, before that call, and SEED_FILE there wraps `torch.manual_seed` to
add k. Seed 0 passes no file: nanoGPT's own run.
"""

from __future__ import annotations

import hashlib
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
FLAGS = ["--batch_size=16", "--block_size=256", "--gradient_accumulation_steps=1",
         "--n_layer=4", "--n_head=4", "--n_embd=256", "--dropout=0.0", "--bias=False",
         "--learning_rate=1e-3", "--min_lr=1e-4", "--warmup_iters=50",
         "--max_iters=500", "--lr_decay_iters=500", "--device=cpu", "--dtype=float32",
         "--compile=False", "--eval_interval=500", "--eval_iters=1",
         "--always_save_checkpoint=True"]
STEPS = 500
FILES = ("train.py", "model.py", "configurator.py")
SEED_FILE = """\
# seed {seed}: train.py's torch.manual_seed(1337 + seed_offset) becomes 1337 + seed_offset + {seed}
import torch as _torch
_manual_seed = _torch.manual_seed
_torch.manual_seed = lambda s: _manual_seed(s + {seed})
"""


def check(snapshot: Path) -> None:
    if not all((snapshot / f).is_file() for f in FILES):
        raise SystemExit(f"speedrun: {snapshot} is not a nanoGPT checkout (no "
                         f"{', '.join(FILES)}); clone github.com/karpathy/nanoGPT")


def train(snapshot: Path, data: Path, run: Path, threads: int, seed: int = 0,
          steps: int = STEPS) -> dict:
    """nanoGPT's train.py on the prepared tokens, seeded `seed` (module docstring), for `steps`
    steps (fewer than STEPS: a run to time its steps, with the schedule and checkpoint of STEPS);
    its training seconds, each step's seconds and its checkpoint."""
    from ddpgpt.data.shards import TokenDataset, open_shard
    if run.exists():
        shutil.rmtree(run)
    (run / "data" / "corpus").mkdir(parents=True)
    for name in FILES:
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
    seeded = []
    if seed:
        (run / "seed.py").write_text(SEED_FILE.format(seed=seed))
        seeded = ["seed.py"]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    print(f"$ (cd {run} && python train.py --dataset=corpus {' '.join(seeded)} ...)", flush=True)
    # its own session, as ddpgpt's trainer has: Linux's autogroup scheduling shares the CPU between
    # sessions, so both sides then get the same share of a busy machine
    log = subprocess.run([sys.executable, "train.py", *seeded, "--dataset=corpus",
                          "--out_dir=out", *FLAGS, f"--max_iters={steps}"], cwd=run, env=env,
                         capture_output=True, text=True, start_new_session=True)
    (run / "train.log").write_text(log.stdout + log.stderr)
    if log.returncode != 0:
        raise SystemExit(f"speedrun: nanoGPT failed (exit {log.returncode}); its output is in "
                         f"{run / 'train.log'}")
    times = step_seconds(log.stdout, steps)
    train_s = sum(times)
    return {"seed": seed, "train_s": train_s, "step_s": statistics.median(times), "times": times,
            "tokens_per_s": steps * 16 * 256 / train_s, "checkpoint": run / "out" / "ckpt.pt"}


def stamp(snapshot: Path, data: Path, threads: int, seed: int) -> str:
    """What a finished run's figures depend on: nanoGPT's files, the flags, the seed, the threads
    and the prepared tokens (their meta.json, which holds every shard's sha256)."""
    files = {f: hashlib.sha256((snapshot / f).read_bytes()).hexdigest() for f in FILES}
    return json.dumps({"files": files, "flags": FLAGS, "steps": STEPS, "seed": seed,
                       "threads": threads, "data": (data / "meta.json").read_text()},
                      sort_keys=True)


def step_seconds(log: str, steps: int) -> list[float]:
    """Each step's seconds from nanoGPT's log lines `iter N: loss L, time Tms, mfu M%`, for steps
    0 .. steps - 1."""
    times = {int(m.group(1)): float(m.group(2)) / 1000 for m in
             re.finditer(r"^iter (\d+): loss \S+, time ([\d.]+)ms", log, re.M)}
    missing = [i for i in range(steps) if i not in times]
    if missing:
        raise SystemExit(f"speedrun: nanoGPT's log has no time for step {missing[0]}")
    return [times[i] for i in range(steps)]


def score(snapshot: Path, checkpoint: Path, data: Path, threads: int) -> float:
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

"""What the tests of tests/e2e/test_hf_*.py share: the corpus, the small shape and batch of their
runs, and two small helpers (a command that must succeed; a run's newest checkpoint as a model).
The bpe run they share is the `bpe` fixture of tests/e2e/conftest.py."""

from __future__ import annotations

import sysconfig
from pathlib import Path

from ddpgpt.checkpoint import read
from ddpgpt.config.io import from_dict
from ddpgpt.model.gpt import GPT

STDLIB = Path(sysconfig.get_paths()["stdlib"])
DOCS = ["textwrap.py", "shlex.py", "bisect.py", "heapq.py", "fnmatch.py", "glob.py"]
SMALL = ["--data.micro-batch", "2", "--data.global-batch", "8", "--data.eval-windows", "8",
         "--optim.warmup-steps", "2", "--optim.lr", "1e-2", "--device", "cpu",
         "--run.threads", "1"]
SHAPE = ["--model.n-layer", "2", "--model.n-head", "2", "--model.n-embd", "32",
         "--model.block-size", "32"]


def _ok(r):
    assert r.returncode == 0, r.stderr
    return r


def _model(run: Path) -> tuple[GPT, dict]:
    path, meta, state = read.load_latest(run / "checkpoints")
    model = GPT(from_dict(meta["config"]).model).eval()
    model.load_state_dict(state["model"])
    return model, state["model"]

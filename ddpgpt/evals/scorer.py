"""Every eval task of a run, whatever its kind (kinds.py): each rank prepares its share of each
task once (`Scorer(...)`), then scores them all at each evaluation (`score`), each task by its
kind's scorer.

    scorer = Scorer(tasks.for_run(cfg.run), tokenizer, cfg.model.block_size, env)
    scorer.score(model)   # {NAME_<metric>: ..., NAME_n: examples, NAME_s: seconds} per task
"""

from __future__ import annotations

import contextlib
import time

import torch

from ddpgpt.distributed.group import DistEnv
from ddpgpt.evals import kinds
from ddpgpt.evals.tasks import Task


class Scorer:
    """One or more tasks, each rank holding its prepared share of each."""

    def __init__(self, tasks: list[Task], tokenizer, block_size: int, env: DistEnv):
        self.tasks = [(task.name, kinds.load(kinds.KINDS[task.kind].scorer)(
            task, tokenizer, block_size, env)) for task in tasks]

    def score(self, model: torch.nn.Module, autocast=contextlib.nullcontext,
              progress: bool = False) -> dict:
        """{NAME_<metric> for the kind's metrics, NAME_n, NAME_s} for every task: collective.
        Call it on the unwrapped model, on every rank. `progress`: a bar on rank 0 (`ddpgpt
        eval`)."""
        was_training = model.training
        model.eval()
        out = {}
        try:
            for name, scorer in self.tasks:
                start = time.perf_counter()
                scores = scorer.score(model, autocast, progress and name)
                out.update({f"{name}_{key}": value for key, value in scores.items()})
                out[f"{name}_s"] = time.perf_counter() - start
        finally:
            model.train(was_training)
        return out

"""A run's model from its checkpoint directory, in one place: `eval`, `sample` and `export` (and
anything else that wants trained weights) ask here for the newest complete checkpoint, or one
step's, and for the model it holds."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ddpgpt.checkpoint.store import load, load_latest, load_weights, read_meta, step_dir, step_dirs
from ddpgpt.config.io import from_dict
from ddpgpt.config.schema import TrainConfig
from ddpgpt.errors import UserError
from ddpgpt.model import GPT


@dataclass
class Saved:
    """One checkpoint of a run: where it is, its meta.json, the config it was trained with, and
    its weights (whole, on the CPU)."""
    path: Path
    meta: dict
    config: TrainConfig
    weights: dict[str, torch.Tensor]

    @property
    def step(self) -> int:
        return int(self.meta["step"])


def saved(run_dir, step: int = 0) -> Saved:
    """`run_dir` (a RunDir)'s newest complete checkpoint, or that of `step`; one line when there
    is none."""
    if step:
        path = step_dir(run_dir.checkpoints, step)
        if not path.is_dir():
            have = [s for s, _ in step_dirs(run_dir.checkpoints)]
            listed = ", ".join(map(str, have)) if have else "none"
            raise UserError(f"run {run_dir} has no checkpoint at step {step} (it has: {listed}); "
                            "give one of those, or leave --step out for the newest")
        meta = read_meta(path)
        found = path, meta, load(path, meta, weights_only=True)
    else:
        found = load_latest(run_dir.checkpoints)
        if found is None:
            raise UserError(f"run {run_dir} has no complete checkpoint; train first "
                            f"(ddpgpt train --run-dir {run_dir})")
    path, meta, state = found
    return Saved(path, meta, from_dict(meta["config"], source=str(path / "meta.json")),
                 state["model"])


def model_of(found: Saved, device: torch.device | str) -> GPT:
    """The model a checkpoint holds, on `device`, in eval mode."""
    model = GPT(found.config.model).to(device)
    load_weights(found.path, model, found.weights)
    return model.eval()


def load_model(run_dir, device: torch.device | str, step: int = 0) -> tuple[GPT, Saved]:
    """The model of `run_dir`'s newest checkpoint (or `step`'s) on `device`, in eval mode."""
    found = saved(run_dir, step)
    return model_of(found, device), found

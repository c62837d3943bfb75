"""Validation loss: token-weighted over the loader's fixed windows, all-reduced across ranks (the
same figure at any number of processes). `ddpgpt eval` and the Trainer's evaluations both call
`evaluate`; bits per byte of text comes from it (TokenDataset.bits_per_byte)."""

from __future__ import annotations

import contextlib

import torch

from ddpgpt.data.loader import EvalLoader
from ddpgpt.distributed import collectives
from ddpgpt.distributed.group import DistEnv
from ddpgpt.progress import bar as progress_bar


@torch.no_grad()
def evaluate(model: torch.nn.Module, loader: EvalLoader, env: DistEnv,
             autocast=contextlib.nullcontext, progress: bool = False) -> float:
    """Mean cross-entropy per target token over every rank's windows.

    Each rank sums its losses and counts its targets (padding rows have none); one all-reduce of
    the two sums makes the result exactly the single-process value up to float rounding. Call it
    on the unwrapped model: the forward then runs no collectives, and the single all-reduce is
    the only sync point. `progress`: a bar on rank 0 (`ddpgpt eval`; a line every few seconds
    when stderr is a log file, not a terminal)."""
    was_training = model.training
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=env.device)  # (loss sum, target count)
    batches = loader
    if progress and env.is_main:
        batches = progress_bar(loader, total=loader.num_batches, desc="eval", unit="batch")
    for x, y in batches:
        with autocast():
            _, loss = model(x, y, reduction="sum")
        totals[0] += loss.double()
        totals[1] += (y >= 0).sum()
    collectives.all_reduce(env, totals)
    model.train(was_training)
    return (totals[0] / totals[1]).item()

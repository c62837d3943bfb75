"""Validation loss: token-weighted over the loader's fixed windows, all-reduced across ranks (the
same figure at any number of processes). `ddpgpt eval` and the Trainer's evaluations both call
`evaluate`; bits per byte of text comes from it (TokenDataset.bits_per_byte). A run's
evaluation (`EvalSet`, `evaluate_sets`) scores the val split and a fixed sample of training
windows (train_eval_loss) of its dataset, or of each dataset of a mixture."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from ddpgpt.data.loader import EvalLoader
from ddpgpt.data.mixture import MixedDataset
from ddpgpt.data.shards import TokenDataset
from ddpgpt.distributed import collectives
from ddpgpt.distributed.group import DistEnv
from ddpgpt.progress import bar as progress_bar


@torch.no_grad()
def evaluate(model: torch.nn.Module, loader: EvalLoader, env: DistEnv,
             autocast=contextlib.nullcontext, progress: bool | str = False) -> float:
    """Mean cross-entropy per target token over every rank's windows.

    Each rank sums its losses and counts its targets (padding rows have none); one all-reduce of
    the two sums makes the result exactly the single-process value up to float rounding. Call it
    on the unwrapped model: the forward then runs no collectives, and the single all-reduce is
    the only sync point. `progress`: a bar on rank 0, named so when a string (`ddpgpt eval`, a
    run's final evaluation; a line every few seconds when stderr is a log file, not a
    terminal)."""
    was_training = model.training
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=env.device)  # (loss sum, target count)
    batches = loader
    if progress and env.is_main:
        batches = progress_bar(loader, total=loader.num_batches, unit="batch",
                               desc=progress if isinstance(progress, str) else "val")
    for x, y in batches:
        with autocast():
            _, loss = model(x, y, reduction="sum")
        totals[0] += loss.double()
        totals[1] += (y >= 0).sum()
    collectives.all_reduce(env, totals)
    model.train(was_training)
    return (totals[0] / totals[1]).item()


@dataclass
class EvalSet:
    """One dataset's windows an evaluation scores."""

    name: str | None       # a mixture's source (keys val_loss/NAME); None: the run's one dataset
    share: float           # its weight in the mixture's totals
    dataset: TokenDataset
    val: EvalLoader
    train: EvalLoader | None  # the training sample (data.train_eval_windows); None: off


def eval_sets(data: TokenDataset | MixedDataset, *, seq_len: int, micro_batch: int,
              world_size: int, rank: int, eval_windows: int, train_windows: int, seed: int,
              device, align: str = "stream", cache: str = "") -> list[EvalSet]:
    """The val windows (eval_windows, evenly spaced) and the training sample (train_windows
    drawn by `seed`; -1: as many as val; 0: none) of each dataset."""
    parts = list(zip(data.names, data.weights, data.datasets)) \
        if isinstance(data, MixedDataset) else [(None, 1.0, data)]
    out = []
    for name, share, ds in parts:
        common = dict(seq_len=seq_len, micro_batch=micro_batch, world_size=world_size,
                      rank=rank, device=device, align=align, cache=cache)
        val = EvalLoader(ds, max_windows=eval_windows, **common)
        count = len(val.windows) if train_windows < 0 else train_windows
        train = EvalLoader(ds, max_windows=count, split="train", sample_seed=seed,
                           **common) if count else None
        out.append(EvalSet(name, share, ds, val, train))
    return out


def evaluate_sets(model: torch.nn.Module, sets: list[EvalSet], env: DistEnv,
                  autocast=contextlib.nullcontext, progress: bool = False) -> dict:
    """An eval row's losses: val_loss, val_bpb (absent without byte counts), train_eval_loss.
    A mixture's: each source's under KEY/NAME and, under KEY, their share-weighted sum (bpb:
    the weighted sum of the sources' bpb, when each has one), with each weight as weight/NAME.
    Collective. `progress`: a bar on rank 0 for each set of windows."""
    row: dict = {}
    for s in sets:
        suffix = f"/{s.name}" if s.name is not None else ""
        named = f" {s.name}" if s.name is not None else ""
        val = evaluate(model, s.val, env, autocast, progress and f"val{named}")
        row[f"val_loss{suffix}"] = val
        bpb = s.dataset.bits_per_byte(val)
        if bpb is not None or s.name is None:
            row[f"val_bpb{suffix}"] = bpb
        if s.train is not None:
            row[f"train_eval_loss{suffix}"] = evaluate(model, s.train, env, autocast,
                                                       progress and f"train sample{named}")
    if sets[0].name is None:
        return row
    for key in ("val_loss", "val_bpb", "train_eval_loss"):
        parts = [(s.share, row.get(f"{key}/{s.name}")) for s in sets]
        if all(v is not None for _, v in parts):
            row[key] = sum(w * v for w, v in parts)
    row.setdefault("val_bpb", None)
    row.update({f"weight/{s.name}": s.share for s in sets})  # what the sums above were weighted by
    return {"val_loss": row.pop("val_loss"), "val_bpb": row.pop("val_bpb"), **row}


def val_text(row: dict) -> str:
    """An eval row's val loss as a line says it: "val_loss 2.3000", and a mixture's as the sum
    it is, of the weights in force at that evaluation (it moves when they change; each source's
    loss does not): "val_loss 2.3000 = 0.7 × a 2.0000 + 0.3 × b 3.0000"."""
    text = f"val_loss {row['val_loss']:.4f}"
    each = {k.split("/", 1)[1]: v for k, v in row.items() if k.startswith("val_loss/")}
    weights = {n: row.get(f"weight/{n}") for n in each}
    if each and None not in weights.values():
        text += " = " + " + ".join(f"{weights[n]:g} × {n} {v:.4f}" for n, v in each.items())
    elif each:  # a row written before the weights were
        text += " (" + ", ".join(f"{n} {v:.4f}" for n, v in each.items()) + ")"
    return text

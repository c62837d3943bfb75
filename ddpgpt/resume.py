"""The trainer's side of checkpoints: which one to resume from, restoring it, saving one, and
`--reset`. File formats and atomicity live in `checkpoint.py`.

A checkpoint holds the sum of the trainer's state: model weights, optimizer state, the step, the
loader's global cursor, every rank's RNG state and the resolved config. Restoring all of it makes
n straight steps equal k steps + resume + n-k steps, bitwise at the same world size.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ddpgpt import checkpoint, dist
from ddpgpt.config import TrainConfig
from ddpgpt.errors import UserError

if TYPE_CHECKING:
    from ddpgpt.train import Trainer

SHAPE_FIELDS = ("n_layer", "n_head", "n_embd", "block_size", "vocab_size", "bias")


def find_resume(cfg: TrainConfig, restart_count: int = 0) -> tuple[Path, dict] | None:
    """The checkpoint to continue from under run.resume, shape-checked; reads files only, so every
    rank can call it before the process group exists."""
    mode = cfg.run.resume
    existing = checkpoint.step_dirs(cfg.run.dir)
    if mode == "reset" and restart_count == 0:
        return None  # reset_run_dir moves them aside once the group exists
    if mode == "never":
        if existing:
            raise UserError(f"run dir {cfg.run.dir} already has checkpoints (up to step {existing[-1][0]}) and "
                            "run.resume = never; use --resume auto to continue, --reset to start over, or another --run-dir")
        return None
    if mode in ("auto", "reset"):  # reset after an elastic restart: continue what this job started
        found = checkpoint.find_latest(cfg.run.dir)
    else:
        found = Path(mode), checkpoint.read_meta(Path(mode))
    if found:
        saved = found[1]["config"]["model"]
        diff = [f"{k} {saved[k]} -> {getattr(cfg.model, k)}" for k in SHAPE_FIELDS if saved[k] != getattr(cfg.model, k)]
        if diff:
            raise UserError(f"run dir {cfg.run.dir}: refused to resume checkpoint {found[0].name}, which has another "
                            f"model shape ({', '.join(diff)}); use another --run-dir, or --reset to set the old run aside")
    return found


def reset_run_dir(run_dir: str | Path) -> Path | None:
    """Moves checkpoints/ and metrics.jsonl into reset-<time>/ (rank 0, before training starts):
    nothing is deleted."""
    run_dir = Path(run_dir)
    moving = [p for p in (run_dir / "checkpoints", run_dir / "metrics.jsonl") if p.exists()]
    if not moving:
        return None
    aside = run_dir / time.strftime("reset-%Y%m%d-%H%M%S")
    aside.mkdir()
    for path in moving:
        os.rename(path, aside / path.name)
    print(f"ddpgpt: --reset: moved the previous checkpoints and metrics to {aside}", file=sys.stderr)
    return aside


def restore(t: Trainer, path: Path, meta: dict) -> None:
    """Model, optimizer, loader cursor, step and RNG from checkpoint `path` (on every rank)."""
    checkpoint.load_weights(path, t.raw)
    state = checkpoint.load_trainer_state(path)
    t.optimizer.load_state_dict(state["optimizer"])
    if t.scaler is not None and state.get("scaler"):
        t.scaler.load_state_dict(state["scaler"])
    t.loader.load_state_dict(meta["loader"])
    t.step = t.last_checkpoint = int(meta["step"])
    t.elapsed_s, t.skipped = float(meta.get("elapsed_s", 0.0)), int(meta.get("skipped_steps", 0))
    rng = state["rng"]
    if meta["world_size"] == t.env.world_size:
        # clone(): set_rng_state crashes (torch 2.13) on a row view with a storage offset.
        torch.set_rng_state(rng["cpu"][t.env.rank].clone())
        if rng.get("cuda") is not None and t.env.device.type == "cuda":
            torch.cuda.set_rng_state(rng["cuda"][t.env.rank].clone(), t.env.device)
    else:  # another W: per-rank streams cannot carry over; start fresh ones from (seed, step, rank)
        seed_rank_rng(t.cfg, t.env.rank, t.step)
    if t.env.is_main:
        print(f"resuming from {path} (step {t.step}, saved at world size {meta['world_size']})", file=sys.stderr)


def seed_rank_rng(cfg: TrainConfig, rank: int, step: int = 0) -> None:
    """Seeds this rank's global RNG (dropout) from (seed, rank, step); model init never uses it."""
    torch.manual_seed(cfg.run.seed + 1 + rank + 1_000_003 * step)


def save(t: Trainer) -> None:
    """Checkpoint at the current step: all ranks gather RNG states, rank 0 writes, all wait."""
    rng = {"cpu": dist.all_gather(t.env, torch.get_rng_state().to(t.env.device)).cpu()}
    if t.env.device.type == "cuda":
        rng["cuda"] = dist.all_gather(t.env, torch.cuda.get_rng_state(t.env.device).to(t.env.device)).cpu()
    if t.env.is_main:
        state = {"optimizer": t.optimizer.state_dict(), "rng": rng,
                 "scaler": t.scaler.state_dict() if t.scaler is not None else None}
        meta = {"loader": t.loader.state_dict(), "config": t.cfg.to_dict(), "world_size": t.env.world_size,
                "elapsed_s": t.elapsed_s, "skipped_steps": t.skipped, "data_fingerprint": t.dataset.fingerprint}
        checkpoint.save(t.run_dir, t.step, t.raw, state, meta, t.cfg.run.keep_checkpoints)
    t.last_checkpoint = t.step
    dist.barrier(t.env)  # no rank runs ahead (or exits) while rank 0 is still writing

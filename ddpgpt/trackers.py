"""Experiment trackers: TensorBoard and Weights & Biases as mirrors of metrics.jsonl, on rank 0.

    ddpgpt train ... --run.tracker tensorboard   # then: tensorboard --logdir runs/NAME/tensorboard
    ddpgpt train ... --run.tracker wandb         # W&B; WANDB_MODE=offline keeps it on this disk

Each logs the scalars of every metrics.jsonl row under the same names (loss, lr, grad_norm,
tokens, tokens_per_s, mfu, elapsed_s; val_loss, val_bpb) against the optimizer step, and the
resolved config as hyperparameters. metrics.jsonl stays the record; a tracker only mirrors it.

A resumed run continues the same tracker run. TensorBoard: the same directory, and the new
writer's purge step discards what a crashed run logged after the checkpoint it resumes from (as
metrics.jsonl is cut back). W&B: the run's id is kept in the run dir (tracker.json) and passed
back with resume="allow"; rows are plotted against our `step`, so steps logged again after a
crash sit beside the old ones instead of being dropped.
"""

from __future__ import annotations

import importlib.util
import json
import secrets
import string
from pathlib import Path

from ddpgpt.errors import UserError
from ddpgpt.files import replace_text

TRACKERS = ("none", "tensorboard", "wandb")
PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}


def check(kind: str) -> None:
    """Before any process starts: the tracker's package is installed, or one line saying how."""
    package = PACKAGES.get(kind)
    if package and importlib.util.find_spec(package) is None:
        raise UserError(f"run.tracker = {kind} needs the {package} package, which is not "
                        "installed: pip install 'ddpgpt[track]' (or run.tracker = none)")


def flat(config: dict, prefix: str = "") -> dict:
    """{"model": {"n_layer": 4}} -> {"model.n_layer": 4}; None becomes "" (hparams take no None)."""
    out = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = "" if value is None else value
    return out


def scalars(row: dict) -> dict[str, float]:
    """A metrics.jsonl row's numbers, without its step (a skipped step's null loss is left out)."""
    return {k: float(v) for k, v in row.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}


class TensorBoard:
    """Event files in RUN/tensorboard/."""

    def __init__(self, log_dir: Path, config: dict, start_step: int):
        from torch.utils.tensorboard.summary import hparams

        self.log_dir = log_dir
        self._open(start_step)
        if start_step == 0:
            for summary in hparams(flat(config), {"val_loss": 0.0}):
                self.writer.file_writer.add_summary(summary)

    def _open(self, start_step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # purge_step: TensorBoard drops events at or after it from earlier files: a crashed
        # run's rows past the checkpoint this run resumes from (metrics.jsonl keeps start_step).
        self.writer = SummaryWriter(str(self.log_dir),
                                    purge_step=start_step + 1 if start_step else None)

    def rewind(self, step: int) -> None:
        """A rollback to `step`: the rows after it are dropped, as from metrics.jsonl."""
        self.writer.close()
        self._open(step)

    def log(self, step: int, row: dict) -> None:
        for name, value in scalars(row).items():
            self.writer.add_scalar(name, value, step)

    def close(self) -> None:
        self.writer.close()


class WandB:
    """A W&B run whose id lives in RUN/tracker.json; its files go into RUN/wandb/."""

    def __init__(self, run_dir: Path, config: dict, project: str):
        import wandb

        state_path = run_dir / "tracker.json"
        state = json.loads(state_path.read_text()) if state_path.is_file() else {}
        run_id = state.get("wandb_id") or "".join(
            secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))
        try:
            self.run = wandb.init(project=project, name=run_dir.resolve().name, id=run_id,
                                  resume="allow", dir=str(run_dir), config=flat(config),
                                  settings=wandb.Settings(silent=True))
        except Exception as e:  # wandb raises its own errors for login, network, settings
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise UserError(f"run.tracker = wandb: cannot start a W&B run ({first}); log in "
                            "(wandb login, or WANDB_API_KEY), or set WANDB_MODE=offline to log "
                            "on this disk, or use run.tracker = none") from None
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")
        if state.get("wandb_id") != run_id:
            replace_text(state_path, json.dumps({**state, "wandb_id": run_id}) + "\n")

    def log(self, step: int, row: dict) -> None:
        self.run.log({**scalars(row), "step": step})

    def rewind(self, step: int) -> None:
        """A rollback to `step`: W&B keeps what was logged (its history cannot be cut), so the
        steps after `step` appear twice, the rolled-back ones first; metrics.jsonl has one row
        each and the rollback event."""

    def close(self) -> None:
        self.run.finish()


def open_tracker(kind: str, run_dir: Path, config: dict, start_step: int, project: str):
    """The tracker of `run.tracker` (rank 0 only), or None for none."""
    run_dir = Path(run_dir)
    if kind == "tensorboard":
        return TensorBoard(run_dir / "tensorboard", config, start_step)
    if kind == "wandb":
        return WandB(run_dir, config, project)
    return None

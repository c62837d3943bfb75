"""Experiment trackers: TensorBoard and Weights & Biases as mirrors of metrics.jsonl, on rank 0.

    ddpgpt train ... --run.tracker tensorboard   # then: tensorboard --logdir runs/NAME/tensorboard
    ddpgpt train ... --run.tracker wandb         # W&B; WANDB_MODE=offline keeps it on this disk

Each logs the scalars of every metrics.jsonl row under the same names (loss, lr, grad_norm,
tokens, tokens_per_s, mfu, elapsed_s; val_loss, val_bpb, train_eval_loss, a mixture's
val_loss/NAME) against the optimizer step, and the resolved config as hyperparameters.
metrics.jsonl stays the record; a tracker only mirrors it.

A resumed run continues the same tracker run, and after a resume or a rollback each tracker shows
what metrics.jsonl keeps. TensorBoard: the same directory, and the new writer's purge step hides
what was logged after the step it goes on from (a crashed run's rows past its checkpoint, a
rollback's undone steps, from step 0 too). W&B: the run's id is kept in the run dir
(tracker.json), and the run is rewound to the rows metrics.jsonl keeps (WandB's docstring).
"""

from __future__ import annotations

import importlib.util
import json
import secrets
import string
from pathlib import Path

from ddpgpt.errors import UserError, warn
from ddpgpt.files import missing, replace_text

PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}


def check(kind: str) -> None:
    """Before any process starts: the tracker's package is installed, or one line saying how."""
    package = PACKAGES.get(kind)
    if package and importlib.util.find_spec(package) is None:
        raise UserError(missing(package, "track", f"run.tracker = {kind}",
                                " (or run.tracker = none)"))


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
        # run's rows past the checkpoint this run resumes from, or a rollback's undone rows
        # (metrics.jsonl keeps start_step). From step 0 too: a rollback to the initial state.
        self.writer = SummaryWriter(str(self.log_dir), purge_step=start_step + 1)

    def rewind(self, step: int, kept: int) -> None:
        """A rollback to `step`: the rows after it are dropped, as from metrics.jsonl."""
        self.writer.close()
        self._open(step)

    def log(self, step: int, row: dict) -> None:
        for name, value in scalars(row).items():
            self.writer.add_scalar(name, value, step)

    def close(self) -> None:
        self.writer.close()


class WandB:
    """A W&B run whose id lives in RUN/tracker.json; its files go into RUN/wandb/.

    W&B numbers its history rows itself (0, 1, ...: one per log call) and can cut a run's
    history back to one of them, that row included (its rewind, `resume_from="ID?_step=N"`).
    Every metrics.jsonl row is one log call, so the K rows metrics.jsonl keeps after a resume or
    a rollback are W&B's rows 0..K-1: the run is rewound to K-1 (K = 0: a new W&B run). Where the
    W&B server refuses to rewind (a preview feature, not enabled for every account), the run
    continues instead, saying so: W&B then shows the undone steps beside the new ones."""

    def __init__(self, run_dir: Path, config: dict, project: str, kept: int | None):
        """`kept`: the rows metrics.jsonl keeps from earlier starts (None: a fresh run)."""
        state_path = run_dir / "tracker.json"
        state = json.loads(state_path.read_text()) if state_path.is_file() else {}
        self.id = state.get("wandb_id") or _new_id()
        self.args = {"project": project, "name": run_dir.resolve().name, "id": self.id,
                     "dir": str(run_dir), "config": flat(config)}
        self.state_path, self.state = state_path, state
        self._start(kept if state.get("wandb_id") else None)

    def _start(self, kept: int | None) -> None:
        import wandb

        if kept == 0:  # nothing to keep: a new W&B run (rewinding keeps at least one row)
            self.id = self.args["id"] = _new_id()
        if self.state.get("wandb_id") != self.id:
            self.state["wandb_id"] = self.id
            replace_text(self.state_path, json.dumps(self.state) + "\n")
        settings = wandb.Settings(silent=True)
        try:
            if kept:
                try:
                    self.run = wandb.init(**self.args, resume_from=f"{self.id}?_step={kept - 1}",
                                          settings=settings)
                    return self._define()
                except Exception as e:  # noqa: BLE001 -- the server's own errors
                    warn(f"run.tracker = wandb: W&B cannot rewind run {self.id} "
                         f"({_first_line(e)}): it keeps the steps metrics.jsonl dropped beside "
                         "the new ones; metrics.jsonl holds each step once")
            self.run = wandb.init(**self.args, resume="allow", settings=settings)
        except Exception as e:  # wandb raises its own errors for login, network, settings
            raise UserError(f"run.tracker = wandb: cannot start a W&B run ({_first_line(e)}); "
                            "log in (wandb login, or WANDB_API_KEY), or set WANDB_MODE=offline "
                            "to log on this disk, or use run.tracker = none") from None
        self._define()

    def _define(self) -> None:
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def log(self, step: int, row: dict) -> None:
        self.run.log({**scalars(row), "step": step})

    def rewind(self, step: int, kept: int) -> None:
        """A rollback to `step`, after which metrics.jsonl keeps `kept` rows."""
        self.run.finish()
        self._start(kept)

    def close(self) -> None:
        self.run.finish()


def _new_id() -> str:
    return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def kept_rows(path: Path, step: int) -> int:
    """The rows a tracker mirrors (every metrics.jsonl row but events) at or before `step`."""
    if not path.is_file():
        return 0
    count = 0
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
            count += row["step"] <= step and "event" not in row
        except (ValueError, KeyError, TypeError):
            continue  # a torn last line from a crash
    return count


def open_tracker(kind: str, run_dir: Path, config: dict, start_step: int, project: str):
    """The tracker of `run.tracker` (rank 0 only), or None for none."""
    run_dir = Path(run_dir)
    if kind == "tensorboard":
        return TensorBoard(run_dir / "tensorboard", config, start_step)
    if kind == "wandb":
        return WandB(run_dir, config, project,
                     kept_rows(run_dir / "metrics.jsonl", start_step) if start_step else None)
    return None

"""`ddpgpt plot RUN [RUN ...]`: runs side by side, from their metrics.jsonl.

    ddpgpt plot runs/adamw runs/muon --out compare.png

Three panels: train loss (exponentially smoothed, the raw rows faint behind it) and val loss
against optimizer steps, the same against tokens, and tokens/s against steps. One colour per run;
the legend names the run dir, its optimizer, sync mode and world size (from config.json and the
newest checkpoint). The picture goes next to the first run (runs/NAME -> runs/NAME.png) unless
--out says otherwise. matplotlib is an optional extra: `pip install 'ddpgpt[plot]'`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ddpgpt.checkpoint import step_dirs
from ddpgpt.config import PlotConfig
from ddpgpt.errors import UserError
from ddpgpt.run_dir import RunDir


def load_run(path: str) -> dict:
    """The run's train rows, val rows and a label; one line if it is not a run dir."""
    run = RunDir(path)
    if not run.metrics.is_file():
        raise UserError(f"{path}: no metrics.jsonl; give run dirs that `ddpgpt train` wrote")
    rows, lines = [], run.metrics.read_text().splitlines()
    for n, line in enumerate(lines, 1):
        try:
            rows.append(json.loads(line))
        except ValueError:
            if n < len(lines):  # a torn last line (a run writing it now) is skipped
                raise UserError(f"{run.metrics}: line {n} is not JSON; the file is damaged "
                                "(restore it, or plot other runs)") from None
    label = Path(path).name or path
    try:
        cfg = json.loads(run.config.read_text())
        label += f" ({cfg['optim'].get('name', 'adamw')}, {cfg['run']['sync']}"
        saved = step_dirs(run.checkpoints)
        if saved:
            meta = json.loads((saved[-1][1] / "meta.json").read_text())
            label += f", W={meta['world_size']}"
        label += ")"
    except (OSError, ValueError, KeyError):
        pass  # a label without the details
    train = [r for r in rows if "loss" in r]
    val = [r for r in rows if "val_loss" in r]
    if not train and not val:
        raise UserError(f"{run.metrics}: no logged steps yet; plot it after its first log row")
    return {"label": label, "train": train, "val": val,
            "tokens_per_step": train[0]["tokens"] / train[0]["step"] if train else None}


def smoothed(values: list[float], beta: float) -> list[float]:
    """Exponential moving average with bias correction (the first values are not pulled to 0)."""
    out, avg = [], 0.0
    for i, v in enumerate(values, 1):
        avg = beta * avg + (1 - beta) * v
        out.append(avg / (1 - beta ** i))
    return out


def draw(runs: list[dict], path: Path, beta: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
    by_step, by_tokens, speed = axes
    for i, run in enumerate(runs):
        colour = f"C{i}"
        train, val, per_step = run["train"], run["val"], run["tokens_per_step"]
        steps = [r["step"] for r in train]
        loss = [r["loss"] for r in train]
        for axis, scale in ((by_step, 1), (by_tokens, per_step)):
            if train:
                axis.plot([s * scale for s in steps], loss, color=colour, alpha=0.15, lw=0.8)
                axis.plot([s * scale for s in steps], smoothed(loss, beta), color=colour,
                          label=f"{run['label']} train")
            if val and scale:
                axis.plot([r["step"] * scale for r in val], [r["val_loss"] for r in val], "o--",
                          color=colour, ms=4, label=f"{run['label']} val")
        if train:
            speed.plot(steps, [r["tokens_per_s"] for r in train], color=colour,
                       label=run["label"])
    by_step.set_xlabel("optimizer step")
    by_tokens.set_xlabel("tokens")
    for axis in (by_step, by_tokens):
        axis.set_ylabel("loss (nats per token)")
        axis.legend(fontsize=7)
        axis.grid(alpha=0.3)
    speed.set_xlabel("optimizer step")
    speed.set_ylabel("tokens/s (all ranks)")
    speed.legend(fontsize=7)
    speed.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run(cfg: PlotConfig) -> None:
    if not cfg.runs:
        raise UserError("plot: give one or more run dirs (ddpgpt plot runs/a runs/b)")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UserError("plot needs matplotlib: pip install 'ddpgpt[plot]'") from None
    runs = [load_run(path) for path in cfg.runs]
    first = Path(cfg.runs[0].rstrip("/"))
    path = Path(cfg.out) if cfg.out else first.with_name(first.name + ".png")
    try:
        draw(runs, path, cfg.smooth)
    except OSError as e:
        raise UserError(f"cannot write {path}: {e.strerror}; choose another --out") from None
    print(f"wrote {path}", file=sys.stderr)

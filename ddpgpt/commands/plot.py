"""`ddpgpt plot RUN [RUN ...]`: runs side by side, from their metrics.jsonl.

    ddpgpt plot runs/adamw runs/muon --out compare.png

Three panels: train loss (smoothed, the raw rows faint behind it) and val loss against optimizer
steps, the same against tokens, and tokens/s against steps (on its right axis the seconds per
step the run waited for data and for checkpoints, if it logged them: plot_waits.py); one with
each eval task's headline score (its kind's: acc_norm for multiple choice) against steps when a
run scored any (run.eval_tasks); and for a mixture two more: each source's val and train-sample
loss (the headline val loss is their sum under the weights in force, so it moves when they
change), and each source's realized share of the rows beside its weight. A star marks where a
run reached its run.target_val_loss; vertical lines on the first panel mark where a run stopped,
resumed with other settings (what changed written along the line) or started again otherwise, or
rolled back past a loss spike. One colour per run, named once in a
legend above the panels (the run dir, its optimizer, sync mode and the world size it trained
most steps at, from config.json and configs.jsonl); solid lines are train loss, circles val
loss. The picture goes next to the first run (runs/NAME -> runs/NAME.png; the URL of a run's
checkpoints, which holds its logs too: NAME.png here) unless --out says otherwise: a file (.png,
.pdf or .svg) or an existing directory (NAME.png inside it).
matplotlib is an optional extra: `pip install 'ddpgpt[plot]'`.

Smoothing is an exponential moving average whose time constant, by default, is 1/20 of the
run's logged rows: a 20-step run is drawn as logged, a 2,000-step one averages ~100 rows. (A
fixed 0.9 left a 20-step curve ~0.3 nats above its own rows: an average lags a falling curve
by about its time constant.) Rows of skipped steps (`"loss": null`) are gaps in the raw curve and
left out of the average.
"""

from __future__ import annotations

import io
import json
import math
import os
import sys
from pathlib import Path

from ddpgpt.checkpoint.store import step_dirs
from ddpgpt.commands.plot_waits import draw_waits
from ddpgpt.config.commands import PlotConfig
from ddpgpt.data import storage
from ddpgpt.errors import UserError, beside
from ddpgpt.evals.kinds import headlines, label_of
from ddpgpt.files import atomic_write, describe, require
from ddpgpt.run.run_dir import RunDir

FORMATS = (".png", ".pdf", ".svg")
MARKS = {"stopped": {"ls": "--"}, "restarted": {"ls": "-."}, "settings changed": {"ls": "-"},
         "rolled back": {"ls": ":"}}
SOURCE_MARKERS = "os^Dv"  # a mixture's sources, one each, in every run


def load_run(path: str) -> dict:
    """The run's train rows, val rows and a label; one line if it is not a run dir or its
    metrics file is not what `ddpgpt train` writes."""
    run = RunDir(path)
    if not run.metrics.is_file():
        what = "no metrics.jsonl" if run.path.exists() else \
            f"no such run dir{beside(path, 'metrics.jsonl', 'runs')}"
        raise UserError(f"{path}: {what}; give run dirs that `ddpgpt train` wrote")
    damaged = "the file is damaged (restore it, or plot other runs)"
    try:
        lines = run.metrics.read_bytes().decode("utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise UserError(f"{run.metrics}: not UTF-8 text (byte {e.start}); {damaged}") from None
    except OSError as e:
        raise UserError(f"{run.metrics}: cannot read it ({describe(e)})") from None
    rows = []
    for n, line in enumerate(lines, 1):
        try:
            row = json.loads(line)
        except ValueError:
            if n < len(lines):  # a torn last line (a run writing it now) is skipped
                raise UserError(f"{run.metrics}: line {n} is not JSON; {damaged}") from None
            continue
        if not isinstance(row, dict) or not isinstance(row.get("step"), int):
            raise UserError(f"{run.metrics}: line {n} is not a metrics row (a JSON object with "
                            f"an integer \"step\"); {damaged}")
        rows.append(row)
    train = [r for r in rows if "loss" in r]
    val = [r for r in rows if _number(r.get("val_loss"))]
    if not train and not val:
        raise UserError(f"{run.metrics}: no logged steps yet; plot it after its first log row")
    per_step = next((r["tokens"] / r["step"] for r in train
                     if _number(r.get("tokens")) and r["step"] > 0), None)
    targets = [r for r in rows if r.get("event") == "target" and _number(r.get("val_loss"))]
    last = max((r["step"] for r in train), default=0)
    changes = changed(rows)
    return {"label": _label(run, path, last), "train": train, "val": val,
            "tokens_per_step": per_step,
            "target": targets[-1] if targets else None, "marks": marks(run, rows, changes),
            "changes": changes, "sources": sorted({k.split("/", 1)[1] for r in val for k in r
                                                   if k.startswith("val_loss/")})}


def changed(rows: list[dict]) -> dict[int, str]:
    """{step: what changed there}: each resume with other settings (a config_change row) or
    mixture weights (mixture_change; its data.dir then goes without saying), as the mark's
    label says it: "optim.lr 0.3→30", "a 0.7→0.5, b 0.3→0.5"."""
    out: dict[int, list[str]] = {}
    for r in rows:
        try:
            if r.get("event") == "mixture_change":
                text = ", ".join(f"{n} {r['old'].get(n, 0):g}→{w:g}" for n, w in r["new"].items())
            elif r.get("event") == "config_change":
                text = ", ".join(f"{k} {_brief(a)}→{_brief(b)}"
                                 for k, (a, b) in r["changes"].items() if k != "data.dir"
                                 or not any(x.get("event") == "mixture_change"
                                            and x["step"] == r["step"] for x in rows))
            else:
                continue
        except (KeyError, TypeError, ValueError, AttributeError):
            text = "settings"  # a row of another shape: the mark without its details
        out.setdefault(r["step"], []).append(text)
    return {step: "; ".join(filter(None, texts)) for step, texts in out.items()}


def _brief(value) -> str:
    text = f"{value:g}" if isinstance(value, float) else str(value)
    return text if len(text) <= 14 else text[:13] + "…"


def marks(run: RunDir, rows: list[dict], changes: dict[int, str]) -> dict[str, list[int]]:
    """The steps where the run's story turned: it stopped (a stop row: a signal, an error) and
    started again from a checkpoint, started with other settings (`changes`) or otherwise again
    (configs.jsonl: another world size), or rolled back past a loss spike (drawn at the
    spike)."""
    starts = []
    if run.configs.is_file():
        for line in run.configs.read_text().splitlines():
            try:
                starts.append(int(json.loads(line)["step"]))
            except (ValueError, KeyError, TypeError):
                continue
    return {"stopped": sorted({r["step"] for r in rows if r.get("event") == "stop"}),
            "restarted": sorted({s for s in starts if s > 0} - set(changes)),
            "settings changed": sorted(changes),
            "rolled back": sorted({r.get("spike_step", r["step"]) for r in rows
                                   if r.get("event") == "rollback"})}


def task_names(runs: list[dict]) -> dict[str, str]:
    """{task: its headline score's key} for the tasks any run scored (evals/kinds.py: the
    eval rows' NAME_acc_norm for multiple choice), in name order."""
    found = {name: key for run in runs for r in run["val"]
             for name, key in headlines(r).items() if _number(r[key])}
    return dict(sorted(found.items()))


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _label(run: RunDir, path: str, last_step: int) -> str:
    """"NAME (optimizer, sync, W=N)", with what config.json says and the world size the run
    trained most steps at (configs.jsonl; the newest checkpoint's for runs that predate it),
    and the others', if any: "W=2; W=1 for 20 of 200 steps"."""
    label = Path(os.path.abspath(path)).name or path
    try:
        cfg = json.loads(run.config.read_text())
        label += f" ({cfg['optim'].get('name', 'adamw')}, {cfg['run']['sync']}"
        steps = steps_per_world_size(run, last_step)
        if steps:
            best = max(steps, key=lambda w: (steps[w], w))
            label += f", W={best}"
            others = sorted(w for w in steps if w != best)
            if others:
                label += (f"; W={', '.join(map(str, others))} for "
                          f"{sum(steps[w] for w in others)} of {sum(steps.values())} steps")
        elif saved := step_dirs(run.checkpoints):
            meta = json.loads((saved[-1][1] / "meta.json").read_text())
            label += f", W={meta['world_size']}"
        label += ")"
    except (OSError, ValueError, KeyError, TypeError):
        pass  # a label without the details
    return label


def steps_per_world_size(run: RunDir, last_step: int) -> dict[int, int]:
    """{W: steps trained at W}: each start in configs.jsonl holds until the next one (a start
    from an older checkpoint replaces what followed it), the last until `last_step`. Starts
    recorded without a world size (older versions) are not counted."""
    starts: list[tuple[int, int | None]] = []
    if run.configs.is_file():
        for line in run.configs.read_text().splitlines():
            try:
                entry = json.loads(line)
                step, world = int(entry["step"]), entry.get("world_size")
            except (ValueError, KeyError, TypeError, AttributeError):
                continue
            starts = [s for s in starts if s[0] < step] + [(step, world)]
    steps: dict[int, int] = {}
    ends = [s for s, _ in starts[1:]] + [last_step]
    for (start, world), end in zip(starts, ends):
        if isinstance(world, int) and end > start:
            steps[world] = steps.get(world, 0) + end - start
    return steps


def smoothed(values: list[float | None], beta: float) -> list[float | None]:
    """Exponential moving average with bias correction (the first values are not pulled to 0);
    None (a skipped step) stays None and does not enter the average."""
    out, avg, n = [], 0.0, 0
    for v in values:
        if not _number(v):
            out.append(None)
            continue
        n += 1
        avg = beta * avg + (1 - beta) * v
        out.append(avg / (1 - beta ** n))
    return out


def auto_beta(rows: int) -> float:
    """A time constant of 1/20 of the run's rows: beta = 1 - 1/tau (0: no smoothing)."""
    tau = max(1.0, rows / 20)
    return 1 - 1 / tau


def out_path(cfg: PlotConfig) -> Path:
    """Where the picture goes, as it will be written (the name printed is the file's)."""
    first = Path(os.path.abspath(cfg.runs[0]))
    if storage.is_url(cfg.runs[0]):  # a run's checkpoint URL: NAME.png here
        first = Path(storage.name_of(cfg.runs[0]))
    default = f"{first.name or 'run'}.png"
    if cfg.out is None:
        return first.with_name(default) if first.name else Path(default)
    path = Path(cfg.out)
    if path.is_dir():
        return path / default
    if path.exists() and not path.is_file():  # a pipe or a device: written as it is, a PNG
        return path
    if path.suffix == "":
        return path.with_name(path.name + ".png")
    if path.suffix.lower() not in FORMATS:
        raise UserError(f"--out {cfg.out}: cannot draw a {path.suffix} file; give a name ending "
                        f"in {', '.join(FORMATS)} (or a directory)")
    return path


def draw(runs: list[dict], beta: float | None, fmt: str) -> bytes:
    """The picture's bytes (`beta` None: each run's own auto_beta)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.ticker import EngFormatter, MaxNLocator

    tasks = task_names(runs)
    mixed = [run for run in runs if run["sources"]]
    panels = 3 + bool(tasks) + 2 * bool(mixed)
    rows_ = 1 if panels <= 4 else 2
    fig, grid = plt.subplots(rows_, min(panels, 4 if rows_ == 1 else 3), squeeze=False,
                             figsize=(21 if panels == 4 else 16, 4.8 * rows_))
    axes = list(grid.flat)
    for extra in axes[panels:]:
        extra.remove()
    axes = axes[:panels]
    by_step, by_tokens, speed = axes[:3]
    per_source, shares = axes[-2:] if mixed else (None, None)
    for i, run in enumerate(runs):
        colour = f"C{i}"
        train, val, per_step = run["train"], run["val"], run["tokens_per_step"]
        steps = [r["step"] for r in train]
        loss = [r["loss"] if _number(r["loss"]) else None for r in train]
        smooth = smoothed(loss, auto_beta(len(train)) if beta is None else beta)
        raw = [math.nan if v is None else v for v in loss]  # NaN: a gap in the line
        for axis, scale in ((by_step, 1), (by_tokens, per_step)):
            if scale is None:
                continue  # rows without token counts: steps only
            x = [s * scale for s in steps]
            axis.plot(x, raw, color=colour, alpha=0.2, lw=0.8)
            axis.plot(x, [math.nan if v is None else v for v in smooth], color=colour, lw=1.6)
            axis.plot([r["step"] * scale for r in val], [r["val_loss"] for r in val], "o",
                      color=colour, ms=5, mec="white", mew=0.8)
            if run["target"] is not None:  # time to target: where the run stopped
                axis.plot(run["target"]["step"] * scale, run["target"]["val_loss"], "*",
                          color=colour, ms=16, mec="black", mew=0.8)
                axis.axvline(run["target"]["step"] * scale, color=colour, ls=":", lw=1)
        for kind, style in MARKS.items():
            for step in run["marks"][kind]:
                by_step.axvline(step, color=colour, alpha=0.6, lw=1, **style)
        for step, text in run["changes"].items():  # what changed, along the mark
            by_step.text(step, 0.98, f" {text}", transform=by_step.get_xaxis_transform(),
                         rotation=90, va="top", ha="right", fontsize=7, color=colour)
        if run["sources"]:
            draw_sources(per_source, shares, run, colour,
                         auto_beta(len(train)) if beta is None else beta)
        speeds = [r.get("tokens_per_s") for r in train]
        speed.plot(steps, [v if _number(v) else math.nan for v in speeds], color=colour)
        for k, key in enumerate(tasks.values()):
            rows = [r for r in val if _number(r.get(key))]
            axes[3].plot([r["step"] for r in rows], [r[key] for r in rows],
                         color=colour, marker="os^Dv"[k % 5], ls="-:"[k % 2], ms=5)
    by_step.set_xlabel("optimizer step")
    by_tokens.set_xlabel("tokens")
    by_tokens.xaxis.set_major_formatter(EngFormatter(sep=""))  # 200k, 1.5M: no long integers
    speed.set_xlabel("optimizer step")
    speed.set_ylabel("tokens/s (all ranks)")
    speed.yaxis.set_major_formatter(EngFormatter(sep=""))
    if tasks:
        axes[3].set_xlabel("optimizer step")
        axes[3].set_ylabel(" / ".join(dict.fromkeys(label_of(task, key)
                                                    for task, key in tasks.items())))
        axes[3].xaxis.set_major_locator(MaxNLocator(integer=True))
        axes[3].legend(handles=[Line2D([], [], color="0.3", marker="os^Dv"[k % 5],
                                       ls="-:"[k % 2], label=task) for k, task in enumerate(tasks)],
                       fontsize=9, frameon=False)
    if mixed:
        label_sources(per_source, shares, sorted({n for run in mixed for n in run["sources"]}))
    for axis in axes:
        axis.grid(alpha=0.3)
    for axis in (by_step, speed):
        axis.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    for axis in (by_step, by_tokens):
        axis.set_ylabel("loss (nats per token)")
    handles = [Line2D([], [], color=f"C{i}", lw=2.5, label=run["label"])
               for i, run in enumerate(runs)]
    # a mixture's val loss is the sum under the weights in force: it moves when they change
    handles += [Line2D([], [], color="0.3", lw=1.6, label="train loss (smoothed)"),
                Line2D([], [], color="0.3", marker="o", ls="", ms=5, label="val loss" + (
                    " (a mixture's: weighted by its weights then)" if mixed else ""))]
    handles += [Line2D([], [], color="0.3", lw=1, alpha=0.6, label=kind, **style)
                for kind, style in MARKS.items() if any(run["marks"][kind] for run in runs)]
    handles += draw_waits(speed, runs)
    if any(run["target"] for run in runs):
        handles.append(Line2D([], [], color="0.3", marker="*", ls="", ms=12, mec="black",
                              label="target val loss reached"))

    fig.legend(handles=handles, loc="upper center", ncol=min(len(handles), 4), fontsize=10,
               frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.07 * math.ceil(len(handles) / 4)))
    buffer = io.BytesIO()
    fig.savefig(buffer, format=fmt, dpi=100)
    plt.close(fig)
    return buffer.getvalue()


def draw_sources(per_source, shares, run: dict, colour: str, beta: float) -> None:
    """A mixture's panels: each source's val loss (markers) and train-sample loss (dashed) at
    each evaluation; each source's realized share of the rows (mix/NAME, smoothed as the loss
    is) and its weight (dotted: the eval rows' weight/NAME, in force up to each)."""
    for k, name in enumerate(run["sources"]):
        marker = SOURCE_MARKERS[k % len(SOURCE_MARKERS)]
        val = [r for r in run["val"] if _number(r.get(f"val_loss/{name}"))]
        per_source.plot([r["step"] for r in val], [r[f"val_loss/{name}"] for r in val],
                        color=colour, marker=marker, ls="-", lw=1, ms=5, gid=f"val {name}")
        fit = [r for r in run["val"] if _number(r.get(f"train_eval_loss/{name}"))]
        per_source.plot([r["step"] for r in fit], [r[f"train_eval_loss/{name}"] for r in fit],
                        color=colour, marker=marker, ls="--", lw=1, ms=4, mfc="none",
                        gid=f"train sample {name}")
        rows = [r for r in run["train"] if _number(r.get(f"mix/{name}"))]
        share = smoothed([r[f"mix/{name}"] for r in rows], beta)
        shares.plot([r["step"] for r in rows], [math.nan if v is None else v for v in share],
                    color=colour, marker=marker, markevery=max(1, len(rows) // 8), ms=5,
                    gid=f"share {name}")
        weight = [r for r in run["val"] if _number(r.get(f"weight/{name}"))]
        shares.plot([r["step"] for r in weight], [r[f"weight/{name}"] for r in weight],
                    color=colour, ls=":", drawstyle="steps-pre", gid=f"weight {name}")


def label_sources(per_source, shares, names: list[str]) -> None:
    from matplotlib.lines import Line2D
    from matplotlib.ticker import MaxNLocator

    per_source.set_title("each source: val (solid), train sample (dashed)", fontsize=10)
    per_source.set_ylabel("loss (nats per token)")
    shares.set_title("mixture: realized share of rows (solid), weight (dotted)", fontsize=10)
    shares.set_ylabel("share of the rows")
    for axis in (per_source, shares):
        axis.set_xlabel("optimizer step")
        axis.xaxis.set_major_locator(MaxNLocator(integer=True))
    per_source.legend(handles=[Line2D([], [], color="0.3", ls="", label=name,
                                      marker=SOURCE_MARKERS[k % len(SOURCE_MARKERS)])
                               for k, name in enumerate(names)], fontsize=9, frameon=False)


def write(path: Path, data: bytes) -> None:
    """Atomically (files.atomic_write); straight into anything that is not a regular file (a
    pipe, a device). A failed write is one line and leaves `path` as it was."""
    special = path.exists() and not path.is_file()
    try:
        with open(path, "wb") if special else atomic_write(path) as f:
            f.write(data)
    except OSError as e:
        raise UserError(f"cannot write {path}: {describe(e)}; choose another --out") from None


def run(cfg: PlotConfig) -> None:
    if not cfg.runs:
        raise UserError("plot: give one or more run dirs (ddpgpt plot runs/a runs/b)")
    path = out_path(cfg)
    require("matplotlib", "plot", "plot")
    runs = [load_run(p) for p in cfg.runs]
    fmt = path.suffix[1:].lower() if path.suffix.lower() in FORMATS else "png"
    write(path, draw(runs, None if cfg.smooth < 0 else cfg.smooth, fmt))
    print(f"wrote {path}", file=sys.stderr)

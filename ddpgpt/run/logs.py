"""A run's logs beside its checkpoints at a URL (run.checkpoint_url): config.json, configs.jsonl
and metrics.jsonl are copied there before each checkpoint (`share`, after the lease is renewed:
`before_checkpoint`), so that `ddpgpt plot URL`
draws the run from the URL alone, and a start whose run dir is behind them (a new machine's
empty one, `train --run-dir NEW --run.checkpoint-url URL`) takes them back (`adopt`) and goes on
with the run's whole history. The run dir's files are the record: those at the URL are as of the
newest checkpoint, and the rows after it are the ones a resume cuts anyway (metrics.cut_log)."""

from __future__ import annotations

import json

from ddpgpt.checkpoint import location
from ddpgpt.errors import warn
from ddpgpt.files import WriteError, atomic_write

SHARED = ("config.json", "configs.jsonl", "metrics.jsonl")
HISTORY = ("configs.jsonl", "metrics.jsonl")  # a start writes its own config.json


def before_checkpoint(run_dir) -> None:
    """Rank 0, before each checkpoint at a URL: the job's lease of it still its own
    (checkpoint/lease.py: LeaseHeld if not), then the logs there."""
    if run_dir.lease is not None:
        run_dir.lease.renew()
    share(run_dir)


def share(run_dir) -> None:
    """Rank 0, before each checkpoint at a URL: the run dir's logs copied there, one PUT each.
    A failure only warns: the run dir keeps them, and the checkpoint's own writes say whether
    the storage is gone."""
    if not run_dir.remote:
        return
    for name in SHARED:
        try:
            data = (run_dir.path / name).read_bytes()
        except FileNotFoundError:
            continue
        try:
            location.replace_file(run_dir.remote / name, data)
        except WriteError as e:
            warn(f"cannot copy {name} to {run_dir.remote} ({e}); the run dir keeps it")
            return


def last_step(text: bytes) -> int:
    """The step of a metrics.jsonl's last row (-1: none); a torn last line is skipped."""
    for line in reversed(text.decode("utf-8", "replace").splitlines()):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            continue
    return -1


def adopt(run_dir) -> None:
    """At a start with a checkpoint URL: when the metrics there go further than the run dir's,
    the URL's metrics.jsonl and configs.jsonl become the run dir's (each written whole)."""
    if not run_dir.remote:
        return
    try:
        there = (run_dir.remote / "metrics.jsonl").read_bytes()
    except FileNotFoundError:
        return
    here = run_dir.metrics.read_bytes() if run_dir.metrics.is_file() else b""
    if last_step(there) <= last_step(here):
        return
    for name in HISTORY:
        try:
            data = there if name == "metrics.jsonl" else (run_dir.remote / name).read_bytes()
        except FileNotFoundError:
            continue
        with atomic_write(run_dir.path / name) as f:
            f.write(data)

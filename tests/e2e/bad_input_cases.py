"""What the bad-input catalogues (tests/e2e/test_bad_input_data.py, test_bad_input_run.py) share:
the context a setup gets and the broken state it returns, the setups both use, one row of a table,
and the check every row goes through.

One row per case: an id, a setup that builds the broken state in tmp_path (from a copy of the
session's `tiny_data`, never the fixture itself), the command line and the expected line. Every
case exits with 2, the code for bad input; the command line exits within seconds with exactly one
line on stderr, "ddpgpt: error: " + what is wrong, where and what to do; no traceback, nothing on
stdout, and nothing written, overwritten or deleted in the data dir or the run dir.

Each command runs in the test's process (tests/in_process.py: `ddpgpt.cli.main`, its output
captured at fds 1 and 2, its exit code from SystemExit), not in a new one: the property is the
line, the code and the untouched dirs, not a process's start (~2 CPU s of imports per case).
tests/unit/test_in_process.py shows the two say the same.
"""

from __future__ import annotations

import hashlib
import shutil
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.helpers import json_error, tiny_train_args
from tests.in_process import run_in_process


@dataclass
class Ctx:
    """What a setup may use: its own tmp dir, the shared dataset (to copy), fixtures on demand and
    an ExitStack for resources held while the command runs (a listening socket)."""

    tmp: Path
    tiny_data: Path
    request: pytest.FixtureRequest
    stack: ExitStack

    def trained_run(self) -> Path:
        return self.request.getfixturevalue("trained_run")


@dataclass
class Case:
    """The broken state: the --data and --run-dir of the command (either may not exist), the
    environment, and facts the expected line quotes (sizes, hashes, a parser's message, a port)."""

    tmp: Path
    data: Path
    run: Path
    env: dict = field(default_factory=dict)
    facts: dict = field(default_factory=dict)


def train(c: Case, *before: str | Path, **overrides) -> list:
    """`train [BEFORE...] <tiny_train_args for 2 steps>` with `overrides` replacing its flags."""
    return ["train", *before, *tiny_train_args(c.data, c.run, steps=2, **overrides)[3:]]


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def snapshot(root: Path) -> tuple[set[str], dict[str, tuple[int, str]]] | None:
    """(directories, {file: (size, sha256)}) under `root`, relative; None when it does not exist."""
    if not root.exists():
        return None
    paths = sorted(root.rglob("*"))
    dirs = {str(p.relative_to(root)) for p in paths if p.is_dir()}
    files = {str(p.relative_to(root)): (p.stat().st_size, sha256(p)) for p in paths if p.is_file()}
    return dirs, files


def truncate_half(path: Path) -> str:
    """Cuts a JSON file to its first half (a write cut short); returns the parse error it now
    has."""
    text = path.read_text()
    path.write_text(text[: len(text) // 2])
    return json_error(text[: len(text) // 2])


def copied(ctx: Ctx) -> Case:
    """An intact copy of the dataset and a run dir that does not exist yet."""
    shutil.copytree(ctx.tiny_data, ctx.tmp / "data")
    return Case(ctx.tmp, ctx.tmp / "data", ctx.tmp / "run")


def row(id_: str, setup: Callable[[Ctx], Case], command: Callable[[Case], list],
        expected: Callable[[Case], str]):
    return pytest.param(setup, command, expected, id=id_)


E = "ddpgpt: error: "


def check(setup, command, expected, tiny_data, tmp_path, request):
    """One case of a catalogue: builds its broken state, runs its command and checks the
    exit code, the time, the one line and that the data and run dirs are unchanged."""
    with ExitStack() as stack:
        c = setup(Ctx(tmp_path, tiny_data, request, stack))
        before = snapshot(c.data), snapshot(c.run)
        start = time.monotonic()
        r = run_in_process(*command(c), env=c.env)
        elapsed = time.monotonic() - start
    output = (f"exit {r.returncode} after {elapsed:.1f} s\nstdout: {r.stdout!r}\n"
              f"stderr: {r.stderr!r}")
    assert "Traceback" not in r.stdout + r.stderr, output
    assert r.returncode == 2, output
    assert elapsed < 30, output
    assert r.stdout == "", output
    assert (len(r.stderr.splitlines()) == 1 and r.stderr.startswith(E)
            and r.stderr.endswith("\n")), output
    assert (snapshot(c.data), snapshot(c.run)) == before, \
        "the failing command changed the data or run dir"
    if before[1] is None:
        assert not c.run.exists()
    line = expected(c)
    assert r.stderr == line + "\n", f"\nactual:   {r.stderr.rstrip()}\nexpected: {line}"

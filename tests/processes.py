"""Test helpers that start processes and watch them: `ddpgpt` as a command (run_cli), W ranks
started as torchrun starts them (Ranks, run_ranks), a command whose output lines are stamped as
they arrive (Launch), and a process tree killed whole (kill_tree)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

from tests.helpers import REPO


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# What the console script `ddpgpt` runs: the package as installed, the current directory not on
# sys.path (as it is for `python -m ddpgpt`).
CONSOLE = [sys.executable, "-c", "import sys; del sys.path[0]; from ddpgpt.cli import main; main()"]



def run_cli(*args: str, timeout: float = 60, env: dict | None = None, cwd: Path | None = None,
            console: bool = False):
    """Runs `python -m ddpgpt ARGS` (`console`: as the console script `ddpgpt ARGS`) and returns
    the CompletedProcess (text output)."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    command = CONSOLE if console else [sys.executable, "-m", "ddpgpt"]
    proc = subprocess.Popen([*command, *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=full_env, cwd=cwd)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)  # with --nproc the workers are not in its process group
        out, err = proc.communicate()
        raise AssertionError(f"ddpgpt {' '.join(map(str, args))} still running after {timeout} s:\n"
                             f"{err[-3000:]}") from None
    except BaseException:  # pytest-timeout or Ctrl-C: leave nothing running
        kill_tree(proc.pid)
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)



class Ranks:
    """W processes started the way torchrun starts them (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_*),
    output to files, all killed if any run past the timeout."""

    def __init__(self, argv_per_rank: list[list[str]], workdir: Path, env: dict | None = None,
                 cwds: list[Path] | None = None, prefixes: list[list[str]] | None = None):
        """`prefixes`: per rank, a command the rank's python runs under (e.g. a shell in its own
        mount namespace, which ends with `"$@"`)."""
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        W, port = len(argv_per_rank), free_port()
        self.procs, self.outs = [], []
        for r, argv in enumerate(argv_per_rank):
            e = {**os.environ, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(W),
                 "LOCAL_WORLD_SIZE": str(W), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                 "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                 "PYTHONFAULTHANDLER": "1",  # a rank that aborts shows its Python stacks
                 **(env or {})}
            out, err = open(workdir / f"rank{r}.out", "w"), open(workdir / f"rank{r}.err", "w")
            self.outs.append((out, err))
            e["PYTHONPATH"] = os.pathsep.join(
                filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
            prefix = prefixes[r] if prefixes else []
            self.procs.append(subprocess.Popen([*prefix, sys.executable, *argv], stdout=out,
                                               stderr=err,
                                               env=e, cwd=cwds[r] if cwds else None,
                                               start_new_session=True))

    def wait(self, timeout: float = 120) -> list[SimpleNamespace]:
        deadline = time.monotonic() + timeout
        try:
            for p in self.procs:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"ranks still running after {timeout} s:\n"
                                 f"{self.report()}") from None
        except BaseException:  # pytest-timeout or Ctrl-C: the ranks run in their own sessions
            self.kill()
            raise
        finally:
            for out, err in self.outs:
                out.close()
                err.close()
        return self.results()

    def results(self) -> list[SimpleNamespace]:
        return [SimpleNamespace(returncode=p.returncode,
                                stdout=(self.workdir / f"rank{r}.out").read_text(),
                                stderr=(self.workdir / f"rank{r}.err").read_text())
                for r, p in enumerate(self.procs)]

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                kill_tree(p.pid)
        for p in self.procs:
            p.wait()

    def report(self) -> str:
        return rank_report(self.results())



def rank_report(results: list[SimpleNamespace]) -> str:
    """Every rank's exit code and the end of its output."""
    return "\n".join(f"--- rank {i} (exit {r.returncode}) ---\n{r.stdout[-2000:]}{r.stderr[-4000:]}"
                     for i, r in enumerate(results))



def codes(results: list[SimpleNamespace]) -> tuple[list[int], str]:
    """(exit codes, every rank's output) for `assert codes(r)[0] == [...], codes(r)[1]`."""
    return [r.returncode for r in results], rank_report(results)



def run_ranks(argv_per_rank: list[list[str]], workdir: Path, timeout: float = 120,
              env: dict | None = None, check: bool = True,
              cwds: list[Path] | None = None,
              prefixes: list[list[str]] | None = None) -> list[SimpleNamespace]:
    ranks = Ranks(argv_per_rank, workdir, env, cwds, prefixes)
    results = ranks.wait(timeout)
    if check and any(r.returncode for r in results):
        raise AssertionError(f"a rank failed:\n{ranks.report()}")
    return results



def descendants(pid: int) -> list[int]:
    """Every process below `pid` (from /proc): torchrun's workers do not share its process group."""
    out, todo = [], [pid]
    while todo:
        parent = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                children = Path(f"/proc/{parent}/task/{tid}/children").read_text().split()
            except OSError:
                continue
            out += map(int, children)
            todo += map(int, children)
    return out



def kill_tree(pid: int) -> list[int]:
    """SIGKILL to `pid` and every process below it; returns the pids it signalled."""
    tree = [pid, *descendants(pid)]
    for p in tree:
        try:
            os.kill(p, signal.SIGKILL)
        except OSError:
            pass
    return tree



class Launch:
    """A command whose merged output lines are read as they come, each stamped with its arrival
    time, so a test can time events (a crash, a restart) from outside the processes."""

    def __init__(self, argv: list[str], env: dict | None = None, cwd: Path | None = None):
        self.lines: list[tuple[float, str]] = []
        self.start = time.monotonic()
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, bufsize=1,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
                                     cwd=cwd or REPO, start_new_session=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def wait(self, timeout: float) -> int:
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"still running after {timeout} s:\n{self.text[-5000:]}") from None
        except BaseException:  # pytest-timeout or Ctrl-C: the launcher runs in its own session
            self.kill()
            raise
        self._reader.join(timeout=10)
        self.end = time.monotonic()
        return code

    def kill(self) -> None:
        if self.proc.poll() is None:
            kill_tree(self.proc.pid)
        self.proc.wait()

    @property
    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)

    def wait_for(self, fragment: str, timeout: float) -> float:
        """Blocks until a line containing `fragment` arrives; returns its arrival time."""
        return self.wait_for_value(
            lambda: next((t for t, line in self.lines if fragment in line), None), timeout)

    def wait_for_value(self, probe, timeout: float):
        """Polls `probe()` until it returns something other than None (while the command runs)."""
        deadline = time.monotonic() + timeout
        while (value := probe()) is None:
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise AssertionError(f"gave up waiting ({timeout} s, or the command ended):\n"
                                     f"{self.text[-5000:]}")
            time.sleep(0.02)
        return value

    def when(self, fragment: str, after: float = 0.0) -> float:
        """Arrival time of the first line containing `fragment` (after time `after`)."""
        for t, line in self.lines:
            if fragment in line and t >= after:
                return t
        raise AssertionError(f"no line with {fragment!r} in:\n{self.text[-5000:]}")

"""Where `prepare` writes: checks of --out, the partial directory beside it (and the partials of
dead prepares), the atomic publish, and a clean exit on SIGTERM or SIGHUP.

Output goes to `.NAME.partial-PID` beside `--out`, renamed to `--out` only when complete. SIGTERM
and SIGHUP remove the partial and exit 128 + N; a partial left by a prepare that died (SIGKILL,
power loss) is removed by the next prepare into the same `--out` once its PID is no longer alive.
"""

from __future__ import annotations

import glob
import os
import shutil
import signal
import threading
from pathlib import Path

from ddpgpt.errors import UserError, warn
from ddpgpt.files import pid_alive

PID_LIMIT = 1 << 22  # Linux's largest pid_max: a bigger number in a partial's name is no PID


def check_out(out: Path, force: bool) -> None:
    """Refuses an --out that cannot become the dataset directory, before anything is created."""
    if out.name in ("", ".."):  # "/", ".", "..": no name to give the partial and to rename to
        raise UserError(f"--out {out} is not a directory name; give a path that ends in one, "
                        "e.g. --out data/mine")
    try:
        if out.exists() and not out.is_dir():
            raise UserError(f"--out {out} is a file; give a directory")
        if out.is_dir() and any(out.iterdir()) and not force:
            raise UserError(f"--out {out} exists and is not empty; pass --force to replace it")
        above = next(p for p in out.parents if p.exists())  # "." or "/" at the latest
    except OSError as e:  # a parent this user may not search or list
        raise _unwritable(out, e) from None
    if not above.is_dir():
        raise UserError(f"--out {out}: {above} is a file, not a directory; give an --out whose "
                        "parents are directories")


def _unwritable(out: Path, e: OSError) -> UserError:
    where = Path(e.filename).parent if e.filename else out.parent
    return UserError(f"--out {out}: cannot write in {where} ({e.strerror}); give a directory you "
                     "can write to")


def make_partial(out: Path, tmp: Path, made: list[Path]) -> None:
    """Creates the missing parents of --out, then the partial directory `tmp`, appending each to
    `made` (for the clean-up); partials that dead prepares left for this --out go first."""
    try:
        for parent in reversed([p for p in out.parents if not p.exists()]):
            parent.mkdir()
            made.append(parent)
        _remove_stale_partials(tmp)
        tmp.mkdir()
        made.append(tmp)
    except OSError as e:
        raise _unwritable(out, e) from None


def _remove_stale_partials(tmp: Path) -> None:
    """Removes `.NAME.partial-PID` directories of this --out NAME whose PID is not alive. A PID
    that is alive keeps its partial, whatever process has it now: a running prepare into this
    --out never loses its output."""
    prefix = tmp.name[:tmp.name.rindex("-") + 1]
    for path in tmp.parent.glob(glob.escape(prefix) + "*"):
        pid = path.name[len(prefix):]
        if _stale(pid):
            shutil.rmtree(path, ignore_errors=True)
            warn(f"removed {path}, the partial output of a prepare (pid {pid}) "
                 "that is no longer running")


def _stale(pid: str) -> bool:
    """`pid` (from a partial's name) is no running prepare: not alive, or our own, which is
    about to make its partial and so cannot have one yet."""
    if not pid.isdigit() or int(pid) >= PID_LIMIT:
        return False  # not a name prepare makes
    return int(pid) == os.getpid() or not pid_alive(int(pid))


def publish(tmp: Path, out: Path) -> None:
    """Renames the finished `tmp` to `out`; an old `out` is moved aside first, deleted last."""
    old = None
    if out.exists():
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        try:
            os.rename(out, old)
        except OSError as e:  # e.g. a mount point: the old --out stays as it was
            raise UserError(f"--out {out}: cannot move it aside to replace it ({e.strerror}); "
                            "remove it yourself or give another --out") from None
    os.rename(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


class Terminated(UserError):
    """prepare stopped by SIGTERM or SIGHUP after removing its partial output; exits 128 + N,
    as the signal would have."""

    label = "stopped"

    def __init__(self, signum: int, message: str):
        super().__init__(f"{signal.Signals(signum).name} {message}")
        self.exit_code = 128 + signum


class _Signalled(BaseException):
    """Raised by the handler: a BaseException, so no library's `except Exception` swallows it."""


class CleanExit:
    """For the duration of a `with`: SIGTERM and SIGHUP raise, so `finally` blocks run and remove
    the partial output (by default the signals end the process on the spot and leave it), and
    leave the block as `Terminated(message)`. After `hold()` a signal waits instead, and is sent
    again once the previous handlers are back at the end of the block."""

    SIGNALS = (signal.SIGTERM, signal.SIGHUP)

    def __init__(self, message: str):
        self.message, self.holding, self.pending = message, False, None
        self._previous: dict = {}

    def _handle(self, signum, frame) -> None:
        if self.holding:
            self.pending = signum
            return
        for sig in self.SIGNALS:
            signal.signal(sig, signal.SIG_IGN)  # a second signal must not cut the clean-up short
        raise _Signalled(signum)

    def __enter__(self) -> CleanExit:
        if threading.current_thread() is threading.main_thread():  # only it may set handlers
            self._previous = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}
        return self

    def __exit__(self, kind, exc, tb) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        if isinstance(exc, _Signalled):
            raise Terminated(exc.args[0], self.message) from None
        if self.pending is not None:
            os.kill(os.getpid(), self.pending)

    def hold(self) -> None:
        self.holding = True



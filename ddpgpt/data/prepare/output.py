"""Where `prepare` writes: checks of --out, the partial directory beside it, its lock, the
atomic publish, and a clean exit on SIGINT, SIGTERM or SIGHUP.

Output goes to `.NAME.partial` beside `--out`, renamed to `--out` only when complete. A prepare
stopped by a signal (exit 128 + N), killed (SIGKILL, power loss) or failed on bad input leaves
the partial with its progress, and the same command continues from there.
"""

from __future__ import annotations

import fcntl
import os
import signal
import threading
from pathlib import Path

from ddpgpt.errors import UserError
from ddpgpt.files import NotMovedAside, publish_dir


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


def partial_of(out: Path) -> Path:
    """Where a prepare into `out` works, beside it: one name per --out, so the same command
    finds the progress of an earlier run and continues it."""
    return out.with_name(f".{out.name}.partial")


def make_partial(out: Path, tmp: Path, made: list[Path]) -> None:
    """Creates the missing parents of --out, then the partial directory `tmp` (unless an
    earlier run left it), appending what it made to `made` (for the clean-up)."""
    try:
        for parent in reversed([p for p in out.parents if not p.exists()]):
            parent.mkdir()
            made.append(parent)
        if not tmp.is_dir():
            tmp.mkdir()
            made.append(tmp)
    except OSError as e:
        raise _unwritable(out, e) from None


class Lock:
    """An exclusive lock on the partial directory for as long as this prepare runs: a second
    prepare into the same --out is refused instead of writing the same files. The kernel drops
    it when the process dies, however it dies."""

    def __init__(self, tmp: Path, out: Path):
        self.tmp, self.out, self._f = tmp, out, None

    def __enter__(self) -> Lock:
        self._f = open(self.tmp / "lock", "a+")
        try:
            fcntl.flock(self._f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._f.close()
            raise UserError(f"--out {self.out}: another prepare is writing it now (into "
                            f"{self.tmp}); wait for it to finish or stop it") from None
        return self

    def __exit__(self, *exc) -> None:
        self._f.close()


def publish(tmp: Path, out: Path) -> None:
    """Renames the finished `tmp` to `out` (files.publish_dir: an old `out` is moved aside
    first, deleted last)."""
    try:
        publish_dir(tmp, out)
    except NotMovedAside as e:  # e.g. a mount point: the old --out stays as it was
        raise UserError(f"--out {out}: cannot move it aside to replace it ({e.strerror}); "
                        "remove it yourself or give another --out") from None


class Terminated(UserError):
    """prepare stopped by SIGINT, SIGTERM or SIGHUP, its progress kept; exits 128 + N, as the
    signal would have."""

    label = "stopped"

    def __init__(self, signum: int, message: str):
        super().__init__(f"{signal.Signals(signum).name} {message}")
        self.exit_code = 128 + signum


class _Signalled(BaseException):
    """Raised by the handler: a BaseException, so no library's `except Exception` swallows it."""


class CleanExit:
    """For the duration of a `with`: SIGINT, SIGTERM and SIGHUP raise, so `finally` blocks run
    (they stop the workers and keep the progress), and leave the block as
    `Terminated(message)`. After `hold()` a signal waits instead, and is sent again once the
    previous handlers are back at the end of the block."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self, message):
        """`message`: the text after the signal's name, or a callable that returns it then."""
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
            message = self.message() if callable(self.message) else self.message
            raise Terminated(exc.args[0], message) from None
        if self.pending is not None:
            os.kill(os.getpid(), self.pending)

    def hold(self) -> None:
        self.holding = True



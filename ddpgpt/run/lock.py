"""A run directory's lock (`.lock`): one run trains in a run dir at a time. flock is advisory and
dies with the process that holds it, so a SIGKILLed run leaves no stale lock; the file names the
holder (PID, host, since when) for the line that refuses another run."""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path

from ddpgpt.errors import UserError, warn
from ddpgpt.files import describe


class RunDirBusy(UserError):
    """Another run holds the run directory's lock."""


class Lock:
    """The lock of the run dir `run` (its `.lock` file)."""

    def __init__(self, run: Path):
        self.run, self.file = run, run / ".lock"
        self.fd: int | None = None

    def take(self, allow_parent: bool = False, wait_s: float = 0.0) -> None:
        """Takes it, or raises RunDirBusy naming the holder. With `allow_parent`, a lock held by
        this process's parent (the `--nproc` launcher) will do. `wait_s`: how long to wait for a
        holder to let go (a job's restart: on a network filesystem a dead node's lock is
        released only when its lease runs out)."""
        deadline, warned = time.monotonic() + wait_s, False
        while True:
            try:
                return self._take(allow_parent)
            except RunDirBusy:
                if time.monotonic() >= deadline:
                    raise
                if not warned:
                    warn(f"run dir {self.run} is locked by {self.holder()}; this restart waits "
                         f"up to {wait_s:g} s for it to be released (a node that left holds it "
                         "until its lease runs out)")
                    warned = True
                time.sleep(0.5)

    def _take(self, allow_parent: bool) -> None:
        try:
            fd = os.open(self.file, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise UserError(f"run dir {self.run}: cannot create {self.file.name}: "
                            f"{describe(e)}; give a writable --run-dir") from None
        try:
            taken = self._free(fd, fcntl.LOCK_EX, allow_parent)
        except RunDirBusy:
            os.close(fd)
            raise
        if not taken:  # the launcher's
            os.close(fd)
            return
        holder = {"pid": os.getpid(), "host": socket.gethostname(),
                  "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        os.ftruncate(fd, 0)
        os.write(fd, (json.dumps(holder) + "\n").encode())
        self.fd = fd

    def check_free(self) -> None:
        """Raises RunDirBusy when another run holds it (this process's launcher will do); takes
        nothing and writes nothing (no `.lock`: no run has trained here)."""
        try:
            fd = os.open(self.file, os.O_RDONLY)
        except OSError:
            return
        try:
            self._free(fd, fcntl.LOCK_SH, allow_parent=True)
        finally:
            os.close(fd)  # releases what it took

    def _free(self, fd: int, how: int, allow_parent: bool) -> bool:
        """flock(fd, how): True when taken, False when held by this process's parent (with
        `allow_parent`), else RunDirBusy."""
        try:
            fcntl.flock(fd, how | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if allow_parent and self.held_by_parent():
                return False
            raise RunDirBusy(f"run dir {self.run} is in use by another run ({self.holder()}); "
                             "wait for it to end or stop it, or use another --run-dir") from None

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # releases the flock
            self.fd = None

    def holder(self) -> str:
        """Who holds the lock, as its file says: "PID 123 on host h, since ..."."""
        try:
            info = json.loads(self.file.read_text())
            return f"PID {info['pid']} on host {info['host']}, since {info['since']}"
        except (OSError, ValueError, KeyError, TypeError):
            return "holder unknown"

    def held_by_parent(self) -> bool:
        """The lock is held by this process's parent on this host: the `--nproc` launcher that
        started this worker."""
        try:
            info = json.loads(self.file.read_text())
        except (OSError, ValueError):
            return False
        return info.get("pid") == os.getppid() and info.get("host") == socket.gethostname()

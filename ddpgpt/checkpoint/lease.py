"""The lease of a checkpoint URL: one job at a time trains into run.checkpoint_url.

A local run dir has its flock (run/run_dir.py); a URL of object storage is seen by every machine
and has none, so two jobs (another run dir, another machine) could train into the same URL and
interleave their steps. The job's rank 0, once it knows whether this start is its job's first
(run/elastic.py, job.json), and before it writes anything at the URL, writes `lease.json` there:

    {"token": a random id of this start, "host", "pid", "run_dir", "since", "renewed_at"}

and rewrites it (renewed_at) after checking that it still holds it: from a thread of its own
every run.lease_stale_s / 4 (`keep`), so a lease is fresh however far apart the checkpoints are,
and before each checkpoint; at the end of the run it deletes it. A renewal the thread cannot
make (the lease taken over, the storage failing) is the main thread's to raise, at the next
step (`failure`: commands/train.py stops every rank with its line).

A start finding a lease of another start:
  - its own job's restart (job.json lists one of its launchers): takes it over (an elastic
    restart, a `--nproc` launcher's restart of its workers) without a word;
  - a lease written on this host by a process that is gone, or not renewed for
    run.lease_stale_s: the job that wrote it is dead; taken over, with a warning naming it;
  - --run.take-over: taken over, the user saying that job is dead;
  - else it refuses, one line: who holds it, since when, and what to do.

What object storage guarantees, and the window that leaves: a PUT is atomic and a GET after it
sees it (read-after-write consistency), but plain S3 has no compare-and-swap that fsspec offers
here. So the lease is read, then written, then read back: two starts that both read "no lease"
before either writes both write, and the one whose read-back shows the other's token refuses.
Two starts whose read, write and read-back do not overlap that way are ordered. The window left
is a start that reads before the other's write and writes after the other's read-back (both
within the same few requests' time): then both go on, and the one overwritten finds it at its
next checkpoint (the renewal sees another token) and stops before writing that checkpoint. The
age of a lease is measured with the clocks of two machines: they must roughly agree (NTP), which
run.lease_stale_s's default (ten minutes) leaves ample room for.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid

from ddpgpt.checkpoint import location
from ddpgpt.errors import UserError, warn
from ddpgpt.files import WriteError

LEASE = "lease.json"
RENEWALS = 4  # renewals per run.lease_stale_s: one or two may fail before the lease goes stale


class LeaseHeld(UserError):
    """Another job trains into this checkpoint URL."""


def _alive_here(info: dict) -> bool | None:
    """Whether the lease's writer still runs: known only on the host that wrote it."""
    if info.get("host") != socket.gethostname() or not isinstance(info.get("pid"), int):
        return None
    try:
        os.kill(info["pid"], 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def describe(info: dict) -> str:
    age = time.time() - float(info.get("renewed_at", 0) or 0)
    return (f"PID {info.get('pid', '?')} on host {info.get('host', '?')}, run dir "
            f"{info.get('run_dir', '?')}, since {info.get('since', '?')}, renewed {age:.0f} s ago")


class Lease:
    """This start's lease of `root` (a checkpoint URL's Remote)."""

    def __init__(self, root, run_dir: str):
        self.root, self.path = root, location.at(root) / LEASE
        self.info = {"token": uuid.uuid4().hex, "host": socket.gethostname(), "pid": os.getpid(),
                     "run_dir": str(run_dir), "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        self.held = False
        self.renewals = 0  # made since acquire, by either thread
        self.failure: UserError | None = None  # the renewing thread's, for the main thread
        self._lock, self._stop = threading.Lock(), threading.Event()

    def read(self) -> dict | None:
        """The lease at the URL, or None (none, or unreadable: a torn writer's is not a job)."""
        try:
            info = json.loads(self.path.read_bytes())
        except (FileNotFoundError, ValueError):
            return None
        return info if isinstance(info, dict) else None

    def _write(self) -> None:
        self.info["renewed_at"] = time.time()
        location.write_file(self.path, (json.dumps(self.info) + "\n").encode())

    def acquire(self, restart: bool, take_over: bool, stale_s: float) -> None:
        """Rank 0, before anything is written at the URL. LeaseHeld (one line) when another
        live job holds it; see the module's docstring for who takes it over."""
        found = self.read()
        if found is not None and not restart:
            age = time.time() - float(found.get("renewed_at", 0) or 0)
            dead = _alive_here(found) is False
            if dead or age > stale_s or take_over:
                why = ("its process is gone" if dead else
                       f"not renewed for {age:.0f} s > run.lease_stale_s {stale_s:g}"
                       if age > stale_s else "--run.take-over")
                warn(f"checkpoint URL {self.root}: taking over the lease of another job "
                     f"({describe(found)}): {why}")
            else:
                self._refuse(found)
        self._write()
        back = self.read()  # another start that wrote meanwhile: the last write wins
        if back is None or back.get("token") != self.info["token"]:
            self._refuse(back or {})
        self.held = True

    def _refuse(self, holder: dict) -> None:
        raise LeaseHeld(f"checkpoint URL {self.root} is leased by another job training into it "
                        f"({describe(holder)}); wait for it to end, give this run another "
                        "--run.checkpoint-url, or, if that job is dead, add --run.take-over "
                        "(a lease not renewed for run.lease_stale_s is taken over by itself)")

    def keep(self, stale_s: float) -> None:
        """Rank 0, once acquired: renews the lease every stale_s / RENEWALS seconds from a
        daemon thread until release(); its first failure stops it and waits in `failure`."""
        threading.Thread(target=self._keep, args=(stale_s / RENEWALS,), name="ddpgpt-lease",
                         daemon=True).start()

    def _keep(self, every_s: float) -> None:
        while not self._stop.wait(every_s):
            try:
                self.renew()
            except UserError as e:
                self.failure = e
                return

    def check(self) -> None:
        """The main thread: raises what the renewing thread could not do, if anything."""
        if self.failure is not None:
            raise self.failure

    def renew(self) -> None:
        """Rank 0, before each checkpoint and on its own clock (`keep`): the lease still ours,
        rewritten with the time; else LeaseHeld, and the run stops before it writes into
        another job's checkpoints."""
        with self._lock:  # one renewal at a time; none after release
            if self._stop.is_set():
                return
            found = self.read()
            if found is None or found.get("token") != self.info["token"]:
                self.held = False
                who = describe(found) if found else "none: it was deleted"
                raise LeaseHeld(f"checkpoint URL {self.root}: this run's lease was taken over by "
                                f"another job ({who}); this run stops before its next checkpoint "
                                "so that the two do not interleave; continue it with another "
                                "--run.checkpoint-url")
            try:
                self._write()
                self.renewals += 1
            except WriteError as e:  # the checkpoint's own writes will say it, if it lasts
                warn(f"checkpoint URL {self.root}: cannot renew the lease: {e}")

    def release(self) -> None:
        """At the end of the run: the renewals stopped, and the lease deleted if still ours
        (quietly: a later start takes a dead job's lease over anyway)."""
        self._stop.set()
        with self._lock:  # a renewal in flight ends first
            if not self.held:
                return
            self.held = False
            try:
                found = self.read()
                if found is not None and found.get("token") == self.info["token"]:
                    self.path.unlink(missing_ok=True)
            except (UserError, WriteError, OSError):
                pass

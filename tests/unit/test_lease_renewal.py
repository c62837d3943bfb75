"""The lease of a checkpoint URL renewed on its own clock (checkpoint/lease.py: Lease.keep),
on a local directory standing for the URL (the lease reads and writes through location.py, the
same calls for both). The lease's clock is faked (its renewed_at), the renewing thread's period
is real but short; every wait is for an event (a renewal made), never a bound on wall time."""

from __future__ import annotations

import json
import time

import pytest

from ddpgpt.checkpoint import lease as leases
from ddpgpt.checkpoint.lease import LEASE, Lease, LeaseHeld

PERIOD_STALE_S = 0.2  # keep()'s argument: renewals every 0.05 s


class Clock:
    def __init__(self, now: float):
        self.now = now

    def time(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch):
    fake = Clock(1_000_000.0)
    monkeypatch.setattr(leases.time, "time", fake.time)
    return fake


def renewed(lease: Lease, count: int) -> None:
    """Waits (at most a minute) until `lease` has made `count` renewals."""
    deadline = time.monotonic() + 60
    while lease.renewals < count and lease.failure is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert lease.renewals >= count, lease.failure


def test_a_lease_is_renewed_between_checkpoints_and_a_second_job_meanwhile_refused(
        tmp_path, clock):
    """Acquired, then no checkpoint for longer than run.lease_stale_s: the thread has renewed
    it, so a second job finds it live and refuses (without the renewals it would take over a
    lease 700 s old, past the 600 s a live job's is kept within)."""
    first = Lease(tmp_path, "/a/run")
    first.acquire(restart=False, take_over=False, stale_s=600)
    acquired = json.loads((tmp_path / LEASE).read_text())["renewed_at"]
    clock.now += 700  # longer than lease_stale_s, and no checkpoint since
    first.keep(PERIOD_STALE_S)
    try:
        renewed(first, 1)
        assert json.loads((tmp_path / LEASE).read_text())["renewed_at"] == acquired + 700
        with pytest.raises(LeaseHeld, match=r"is leased by another job training into it \(PID "
                                            r"\d+ on host .*, run dir /a/run"):
            Lease(tmp_path, "/b/run").acquire(restart=False, take_over=False, stale_s=600)
        assert json.loads((tmp_path / LEASE).read_text())["token"] == first.info["token"]
    finally:
        first.release()
    assert not (tmp_path / LEASE).exists()  # given back at the end
    made = first.renewals
    time.sleep(10 * PERIOD_STALE_S)  # the thread stopped: nothing writes the lease again
    assert first.renewals == made and not (tmp_path / LEASE).exists()


def test_a_lease_taken_meanwhile_is_the_main_threads_to_raise(tmp_path, clock):
    """Another job took the lease over (--run.take-over): the renewing thread stops at its
    next renewal, and the failure waits for the main thread (the training's next step)."""
    first = Lease(tmp_path, "/a/run")
    first.acquire(restart=False, take_over=False, stale_s=600)
    first.check()  # nothing to raise
    second = Lease(tmp_path, "/b/run")
    second.acquire(restart=False, take_over=True, stale_s=600)
    first.keep(PERIOD_STALE_S)
    deadline = time.monotonic() + 60
    while first.failure is None and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(LeaseHeld, match=r"this run's lease was taken over by another job \(PID "
                                        r"\d+ on host .*, run dir /b/run"):
        first.check()
    first.release()  # not ours: left alone
    assert json.loads((tmp_path / LEASE).read_text())["token"] == second.info["token"]
    second.release()

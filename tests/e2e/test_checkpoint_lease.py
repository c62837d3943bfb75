"""One job at a time trains into a checkpoint URL (checkpoint/lease.py), against a real S3 server:
a second job (another run dir, another machine) finding a live job's lease refuses in one line
and writes nothing there; a dead job's lease (its process gone, or not renewed for
run.lease_stale_s) or --run.take-over is taken over; a restart of the same job takes its own;
a job whose lease another took stops before its next checkpoint; a run that ends gives it back;
a lease is renewed on its own clock, between checkpoints. Most jobs train in this process
(tests/in_process.py; --nproc 2's workers are processes): the lease names this process's PID,
alive while the test runs, as a running job's would be."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time

import pytest

from ddpgpt.checkpoint import location
from ddpgpt.checkpoint.lease import LEASE, Lease, LeaseHeld
from tests.helpers import tiny_train_args
from tests.in_process import run_in_process
from tests.processes import Launch

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]


def train(data, run_dir, url, *extra):
    args = tiny_train_args(data, run_dir, 2, run__checkpoint_every=1)[3:]
    return run_in_process("train", *args, "--run.checkpoint-url", url, *extra)


def foreign(url, host="node-7", age=0.0) -> dict:
    """A lease as another job on another machine wrote it, renewed `age` seconds ago."""
    info = {"token": "theirs", "host": host, "pid": 4242, "run_dir": "/elsewhere/run",
            "since": "2026-11-28 08:00:00", "renewed_at": time.time() - age}
    location.write_file(location.at(url) / LEASE, json.dumps(info).encode())
    return info


def steps_at(s3, url) -> list[str]:
    return sorted(p.rsplit("/", 1)[-1] for p in s3.fs().ls(url[5:]) if "step_" in p)


@pytest.mark.parametrize("nproc", [1, 2])
def test_a_second_job_on_a_live_lease_refuses_in_one_line(s3, tiny_data, tmp_path, nproc):
    url = s3.bucket("lease") + "/run"
    held = foreign(url)
    out = train(tiny_data, tmp_path / "second", url, *(["--nproc", "2"] if nproc > 1 else []))
    lines = [line for line in out.stderr.splitlines() if line.startswith("ddpgpt:")]
    assert out.returncode == 2 and len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    assert re.fullmatch(
        rf"ddpgpt: error: checkpoint URL {url} is leased by another job training into it \(PID "
        r"4242 on host node-7, run dir /elsewhere/run, since 2026-11-28 08:00:00, renewed \d+ s "
        r"ago\); wait for it to end, give this run another --run.checkpoint-url, or, if that job "
        r"is dead, add --run.take-over \(a lease not renewed for run.lease_stale_s is taken over "
        r"by itself\)", lines[0]), lines[0]
    assert steps_at(s3, url) == []  # nothing of the second job's written there
    assert json.loads(s3.fs().cat_file(f"{url[5:]}/{LEASE}")) == held  # nor the lease touched


@pytest.mark.parametrize("how", ["stale", "take-over", "process gone"])
def test_a_dead_jobs_lease_is_taken_over_and_given_back_at_the_end(s3, tiny_data, tmp_path, how):
    url = s3.bucket("lease") + f"/{how.replace(' ', '-')}"
    extra = []
    if how == "stale":
        foreign(url, age=120)
        extra = ["--run.lease-stale-s", "60"]
    elif how == "take-over":
        foreign(url)
        extra = ["--run.take-over"]
    else:  # written on this host by a process that has exited since
        gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                              capture_output=True, text=True, check=True)
        info = {"token": "t", "host": __import__("socket").gethostname(),
                "pid": int(gone.stdout), "renewed_at": time.time()}
        location.write_file(location.at(url) / LEASE, json.dumps(info).encode())
    out = train(tiny_data, tmp_path / "run", url, *extra)
    assert out.returncode == 0, out.stderr
    assert f"ddpgpt: warning: checkpoint URL {url}: taking over the lease of another job" \
        in out.stderr
    assert steps_at(s3, url) == ["step_0000001", "step_0000002"]
    assert not s3.fs().exists(f"{url[5:]}/{LEASE}")  # the run ended: given back
    again = train(tiny_data, tmp_path / "run", url, "--run.steps", "3")  # the same run, later
    assert again.returncode == 0 and "taking over" not in again.stderr, again.stderr


def test_a_restart_of_the_same_job_takes_its_own_lease(s3):
    url = s3.bucket("lease") + "/restart"
    foreign(url)  # the job's rank 0 before it was restarted, on another node
    mine = Lease(location.at(url), "/here/run")
    mine.acquire(restart=True, take_over=False, stale_s=3600)
    assert json.loads(s3.fs().cat_file(f"{url[5:]}/{LEASE}"))["token"] == mine.info["token"]
    mine.renew()
    mine.release()
    assert not s3.fs().exists(f"{url[5:]}/{LEASE}")


def test_a_job_whose_lease_was_taken_stops_before_its_next_checkpoint(s3):
    url = s3.bucket("lease") + "/taken"
    first = Lease(location.at(url), "/a/run")
    first.acquire(restart=False, take_over=False, stale_s=3600)
    with pytest.raises(LeaseHeld):  # a second start while the first lives
        Lease(location.at(url), "/b/run").acquire(restart=False, take_over=False, stale_s=3600)
    second = Lease(location.at(url), "/b/run")
    second.acquire(restart=False, take_over=True, stale_s=3600)
    with pytest.raises(LeaseHeld, match=r"this run's lease was taken over by another job \(PID "
                                        r"\d+ on host .*, run dir /b/run"):
        first.renew()
    first.release()  # not ours any more: left alone
    assert json.loads(s3.fs().cat_file(f"{url[5:]}/{LEASE}"))["token"] == second.info["token"]


def test_the_lease_is_renewed_between_checkpoints_and_a_second_job_meanwhile_refused(
        s3, tiny_data, tmp_path):
    """run.lease_stale_s 4 and no checkpoint before the end: the first job holds after step 1
    (until a stop signal) for longer than lease_stale_s, its lease renewed meanwhile by its own
    thread (every 1 s), so a second job finds it live and refuses; stopped, the first checkpoints
    and gives the lease back."""
    url = s3.bucket("lease") + "/renewed"
    args = tiny_train_args(tiny_data, tmp_path / "first", 4, run__checkpoint_every=0)
    first = Launch([sys.executable, *args, "--run.checkpoint-url", url, "--run.lease-stale-s",
                    "4"], env={"DDPGPT_FAULT": "hold@1"})
    try:
        first.wait_for("fault: hold until a stop signal", 120)
        lease = json.loads(s3.fs().cat_file(f"{url[5:]}/{LEASE}"))
        since = lease["renewed_at"]
        while lease["renewed_at"] < since + 5:  # renewed after more than lease_stale_s
            time.sleep(0.2)
            lease = json.loads(s3.fs().cat_file(f"{url[5:]}/{LEASE}"))
            assert first.proc.poll() is None, first.text
        assert steps_at(s3, url) == []  # no checkpoint renewed it
        second = train(tiny_data, tmp_path / "second", url, "--run.lease-stale-s", "4")
        assert second.returncode == 2 and re.search(
            rf"ddpgpt: error: checkpoint URL {url} is leased by another job training into it "
            rf"\(PID {first.proc.pid} on host ", second.stderr), second.stderr
        first.proc.send_signal(signal.SIGTERM)
        assert first.wait(120) == 75, first.text  # stopped with a checkpoint
    finally:
        first.kill()
    assert steps_at(s3, url) == ["step_0000002"]
    assert not s3.fs().exists(f"{url[5:]}/{LEASE}")  # given back


def test_a_renewal_that_fails_between_checkpoints_stops_the_run_at_the_next_step(
        s3, tiny_data, tmp_path, monkeypatch, capsys):
    """The renewing thread meets the storage gone (made to, at once): the main thread says it at
    the next step, as any object storage failing between two checkpoints is said (the step, why,
    the newest complete checkpoint), and exits 1, nothing written there after."""
    from ddpgpt.cli import main
    from ddpgpt.errors import UserError

    def gone(lease, stale_s):
        lease.failure = UserError(f"reading {lease.path}: cannot reach the S3 endpoint (gone)")
        lease.failure.storage = str(lease.root)

    monkeypatch.setattr(Lease, "keep", gone)
    url = s3.bucket("lease") + "/renewal-fails"
    args = tiny_train_args(tiny_data, tmp_path / "run", 4, run__checkpoint_every=0)[3:]
    with pytest.raises(SystemExit) as stop:
        main(["train", *args, "--run.checkpoint-url", url])
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("ddpgpt:")
            and not line.startswith("ddpgpt: training on")]
    assert stop.value.code == 1 and said == [
        f"ddpgpt: error: step 1: reading {url}/{LEASE}: cannot reach the S3 endpoint (gone). The "
        "last complete checkpoint (none yet) is intact: wait until the storage answers, then run "
        "the same command with --reset to start over"], said
    assert steps_at(s3, url) == []

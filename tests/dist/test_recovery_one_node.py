"""Recovery paths of one launcher (--nproc 2) that must not lose progress: reruns and restarts
after --resume PATH, --reset and --resume never; two runs in one run dir; a launcher that is hung
up on or killed; a full disk. Each test reproduces one way these went wrong (see the table in
docs/reliability.md) with the real command line on 2 CPU processes, faults injected through
DDPGPT_FAULT at exact steps. Several launchers as nodes: tests/dist/test_recovery_nodes.py.

The timings printed (run with -s) are the figures quoted in docs/reliability.md.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from ddpgpt.checkpoint import store
from ddpgpt.guard.health import EXIT_PREEMPTED
from tests.dist.recovery_runs import STEPS, assert_same_as_straight, train_args
from tests.helpers import read_metrics
from tests.processes import Launch, run_cli

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]


def steps(run_dir: Path) -> list[int]:
    return [r["step"] for r in read_metrics(run_dir)[0]]


def workers_of(run_dir: Path) -> list[int]:
    """PIDs of the `--nproc` workers of this run (their command line names its config.json)."""
    mine = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if "--resolved-config" in cmdline and str(run_dir) in cmdline:
            mine.append(int(pid))
    return mine


@pytest.fixture(scope="module")
def source(straight):
    """A checkpoint outside the run dirs below: the straight run's step 4, as --resume PATH."""
    return straight / "checkpoints" / "step_0000004"


# ---- 1, 2, 10: first-start rules apply once ------------------------------------------------------

def test_explicit_resume_applies_to_the_first_start_only(straight, source, tiny_data, tmp_path):
    """--resume PATH, stopped after step 6: the message's command (the same one) continues from
    the run dir's step 6, not from PATH, and metrics.jsonl keeps steps 5-6."""
    run_dir = tmp_path / "run"
    job = Launch(train_args(tiny_data, run_dir, "--resume", source),
                 env={"DDPGPT_FAULT": "term@5@1"})
    assert job.wait(180) == EXIT_PREEMPTED, job.text
    assert f"resuming from {source} (step 4" in job.text
    stop = run_dir / "checkpoints" / "step_0000006"
    assert (f"ddpgpt: stopped: at step 6 on a signal to another rank; checkpoint {stop} "
            f"is complete: run the same command to resume (it continues from {run_dir}, not from "
            "--resume again)") in job.text
    again = Launch(train_args(tiny_data, run_dir, "--resume", source))
    assert again.wait(180) == 0, again.text
    assert f"resuming from {stop} (step 6" in again.text
    assert_same_as_straight(run_dir, straight, first_step=5)


def test_restart_after_explicit_resume_continues_from_the_run_dir(straight, source, tiny_data,
                                                                  tmp_path):
    """--resume PATH --max-restarts 1, rank 1 killed after step 7 (the run dir has step 6): the
    restarted group resumes from the run dir's step 6, not from PATH's step 4."""
    run_dir = tmp_path / "run"
    job = Launch(train_args(tiny_data, run_dir, "--resume", source, "--max-restarts", "1"),
                 env={"DDPGPT_FAULT": "kill@7@1"})
    assert job.wait(240) == 0, job.text
    killed = job.when("fault: kill at step 7")
    job.when(f"resuming from {run_dir / 'checkpoints' / 'step_0000006'} (step 6", after=killed)
    assert_same_as_straight(run_dir, straight, first_step=5)


@pytest.mark.parametrize("rule", ["--reset", "--resume never"])
def test_first_start_rules_do_not_apply_to_restarts(rule, straight, tiny_data, tmp_path):
    """--reset and --resume never are rules for the job's first start: after rank 1 is killed
    (after step 5), the restarted group resumes from step 4 instead of resetting again (or
    refusing its own checkpoints)."""
    run_dir = tmp_path / "run"
    if rule == "--reset":  # something to set aside, once
        shutil.copytree(straight, run_dir)
    job = Launch(train_args(tiny_data, run_dir, *rule.split(), "--max-restarts", "1"),
                 env={"DDPGPT_FAULT": "kill@5@1"})
    assert job.wait(240) == 0, job.text
    killed = job.when("fault: kill at step 5")
    job.when(f"resuming from {run_dir / 'checkpoints' / 'step_0000004'} (step 4", after=killed)
    assert_same_as_straight(run_dir, straight)
    assert len(list(run_dir.glob("reset-*"))) == (1 if rule == "--reset" else 0)


def test_reset_stop_hint_does_not_repeat_reset(straight, tiny_data, tmp_path):
    """--reset, stopped after step 4: the message says to rerun without --reset, and doing so
    continues from step 4; the old run stays in the one reset-<time>/ directory."""
    run_dir = tmp_path / "run"
    shutil.copytree(straight, run_dir)
    job = Launch(train_args(tiny_data, run_dir, "--reset"), env={"DDPGPT_FAULT": "term@3"})
    assert job.wait(180) == EXIT_PREEMPTED, job.text
    assert "is complete: run the same command without --reset to resume" in job.text
    again = Launch(train_args(tiny_data, run_dir))
    assert again.wait(180) == 0, again.text
    assert f"resuming from {run_dir / 'checkpoints' / 'step_0000004'} (step 4" in again.text
    assert_same_as_straight(run_dir, straight)
    (aside,) = run_dir.glob("reset-*")
    assert steps(aside) == list(range(1, STEPS + 1))  # the straight run's metrics, set aside whole


# ---- 3: one run per run dir ----------------------------------------------------------------------

def test_second_run_in_the_same_dir_is_refused(tiny_data, tmp_path):
    """A second `train` into a run dir that a running job holds exits 2 at once, naming the
    holder; the first job runs on undisturbed (its metrics are its own: every step once, in
    order) until it is stopped."""
    run_dir = tmp_path / "run"
    first = Launch(train_args(tiny_data, run_dir, run__steps=100_000))
    try:
        first.wait_for("ddpgpt: training on 2 processes", timeout=120)
        second = run_cli(*train_args(tiny_data, run_dir, nproc=0)[3:], timeout=60)
    finally:
        os.kill(first.proc.pid, signal.SIGTERM)
        code = first.wait(180)
    assert code == EXIT_PREEMPTED, first.text
    assert second.returncode == 2, second.stderr
    holder = first.proc.pid  # the --nproc launcher holds the lock for its workers
    assert second.stderr.startswith(f"ddpgpt: error: run dir {run_dir} is in use by another run "
                                    f"(PID {holder} on host {os.uname().nodename}, since ")
    assert second.stderr.endswith("); wait for it to end or stop it, or use another --run-dir\n")
    done = steps(run_dir)
    assert done == list(range(1, len(done) + 1)) and len(done) > 1


# ---- 7, 11: the launcher hung up on, or killed ---------------------------------------------------

def test_sighup_to_the_launcher_stops_with_a_checkpoint(straight, tiny_data, tmp_path):
    """A hang-up (the terminal closed): the launcher forwards SIGHUP; the workers treat it as a stop
    request (checkpoint, exit 75) and the launcher names the checkpoint they wrote; the same
    command then finishes. (SIGQUIT takes the same path: see test_stop_signals.)"""
    run_dir, sig = tmp_path / "run", "HUP"
    job = Launch(train_args(tiny_data, run_dir), env={"DDPGPT_FAULT": f"parent:{sig}@3"})
    assert job.wait(180) == EXIT_PREEMPTED, job.text
    stopped_at = int(job.text.split("stopped: at step ")[1].split()[0])
    saved = run_dir / "checkpoints" / f"step_{stopped_at:07d}"
    line = (f"ddpgpt: stopped: at step {stopped_at} on SIG{sig}; checkpoint {saved} is complete: "
            "run the same command to resume")
    assert job.text.count(line) == 1 and "ddpgpt: stopped" not in job.text.replace(line, ""), \
        job.text  # one line: the launcher does not repeat what rank 0 said
    assert store.read_meta(saved)["reason"] == "stop"
    again = Launch(train_args(tiny_data, run_dir))
    assert again.wait(180) == 0, again.text
    assert_same_as_straight(run_dir, straight)


def test_workers_die_with_their_launcher(straight, tiny_data, tmp_path):
    """SIGKILL to the launcher (after step 3): its workers are gone within seconds, write nothing
    more, and leave no stale lock: the same command takes the run dir and resumes."""
    run_dir = tmp_path / "run"
    job = Launch(train_args(tiny_data, run_dir, run__checkpoint_every=3),
                 env={"DDPGPT_FAULT": "parent:KILL@3"})
    workers = job.wait_for_value(
        lambda: workers_of(run_dir) if len(workers_of(run_dir)) == 2 else None, 120)
    assert job.wait(120) == -signal.SIGKILL, job.text
    killed = job.when("fault: parent:KILL at step 3")
    deadline = time.monotonic() + 10
    while any(Path(f"/proc/{p}").exists() for p in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    gone = time.monotonic()
    assert not any(Path(f"/proc/{p}").exists() for p in workers), "workers outlived their launcher"
    assert [p.name for _, p in store.step_dirs(run_dir / "checkpoints")] == ["step_0000003"]
    print(f"\n[figure] SIGKILL of the --nproc launcher -> its workers gone {gone - killed:.1f} s "
          "after the fault")
    again = Launch(train_args(tiny_data, run_dir, run__checkpoint_every=3))
    assert again.wait(180) == 0, again.text
    assert f"resuming from {run_dir / 'checkpoints' / 'step_0000003'} (step 3" in again.text


def test_worker_killed_by_a_signal_exits_128_plus_n(tiny_data, tmp_path):
    job = Launch(train_args(tiny_data, tmp_path / "run"), env={"DDPGPT_FAULT": "kill@3@1"})
    assert job.wait(120) == 128 + 9, job.text
    assert ("ddpgpt: a worker was killed by SIGKILL (local rank 1); the group was stopped"
            in job.text)


def test_an_error_every_rank_hits_is_printed_once(straight, tiny_data, tmp_path):
    """Resuming with another data.seed: both workers refuse the loader state; the line appears
    once."""
    run_dir = tmp_path / "run"
    shutil.copytree(straight, run_dir)
    r = run_cli(*train_args(tiny_data, run_dir, data__seed=7, run__steps=10)[3:], timeout=120)
    assert r.returncode == 2, r.stderr
    assert [line for line in r.stderr.splitlines() if "error" in line] == [
        "ddpgpt: error: the checkpoint's data order was read with data.seed = 1337, this run "
        "has 7: resume with --data.seed 1337 (the order cannot change mid-run), or start a new "
        "--run-dir"]


# ---- 8: a full disk ------------------------------------------------------------------------------

def mount_namespace() -> list[str] | None:
    """A command prefix that runs a shell in a private mount namespace where tmpfs can be mounted
    (root: unshare -m; else a user namespace, unshare -rm), or None where neither works."""
    for prefix in (["unshare", "-m"], ["unshare", "-rm"]):
        try:
            ok = subprocess.run([*prefix, "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt"],
                                capture_output=True, timeout=10).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            ok = False
        if ok:
            return prefix
    return None


def test_full_disk_during_a_checkpoint(tiny_data, tmp_path):
    """The run dir on a tmpfs too small for all the checkpoints (2 processes, one every step,
    all kept): every rank stops at the first save that does not fit, with one line naming ENOSPC
    and the path; no temporary directory is left; the previous checkpoint is intact."""
    prefix = mount_namespace()
    if prefix is None:
        pytest.skip("cannot mount a tmpfs here (needs root or user namespaces)")
    disk = tmp_path / "disk"
    disk.mkdir()
    run_dir = disk / "run"
    args = train_args(tiny_data, run_dir, run__checkpoint_every=1, run__keep_checkpoints=100,
                      run__steps=40)
    script = (f"mount -t tmpfs -o size=1200k tmpfs {disk} && {' '.join(map(str, args))}; "
              f"echo exit=$?; ls -A {run_dir / 'checkpoints'}")
    out = subprocess.run([*prefix, "sh", "-c", script], capture_output=True, text=True, timeout=240)
    text = out.stdout + out.stderr
    assert "exit=1" in text, text
    failed = [line for line in text.splitlines() if line.startswith("ddpgpt: error:")]
    assert len(failed) == 1, text  # rank 0 says it; rank 1 stops quietly; the launcher adds nothing
    step = int(failed[0].split("step ")[1].split(":")[0])
    assert re.fullmatch(re.escape(
        f"ddpgpt: error: step {step}: cannot write checkpoint "
        f"{run_dir / 'checkpoints' / f'step_{step:07d}'}: "
        f"No space left on device (ENOSPC) on rank ") + "[01]" + re.escape(
        "; its temporary files were removed. The last complete "
        f"checkpoint (step {step - 1}) is intact: free space, then run the same command to resume"),
        failed[0]), failed[0]
    listing = out.stdout.split("exit=1\n")[1].split()
    assert listing == [f"step_{s:07d}" for s in range(1, step)]  # no .tmp-step_* left behind
    assert "Traceback" not in text

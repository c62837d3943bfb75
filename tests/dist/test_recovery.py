"""Recovery paths that must not lose progress: reruns and restarts after --resume PATH, --reset
and --resume never; two runs in one run dir; a launcher that is hung up on or killed; a full
disk; two nodes that restart; an elastic job that loses a node (rank 0's) or gains one. Each
test reproduces one way these went wrong (see the table in docs/reliability.md) with the real
command line on 2 CPU processes, faults injected through DDPGPT_FAULT at exact steps.

The timings printed (run with -s) are the figures quoted in docs/reliability.md.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from ddpgpt.checkpoint import store
from ddpgpt.guard.health import EXIT_PREEMPTED
from tests.helpers import Launch, free_port, read_metrics, run_cli, saved_weights, tiny_train_args

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]
STEPS = 8


def train_args(data, run_dir, *extra, nproc=2, **overrides):
    """`python -m ddpgpt train` of the tiny model, `--nproc 2` by default."""
    overrides.setdefault("run__checkpoint_every", 2)
    launch = ["--nproc", str(nproc)] if nproc else []
    return [sys.executable, *tiny_train_args(data, run_dir, STEPS, **overrides), *launch, *extra]


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
def straight(tiny_data, tmp_path_factory):
    """The uninterrupted reference: 8 steps at W=2, checkpoints every 2 steps (the last 3 kept)."""
    run_dir = tmp_path_factory.mktemp("straight") / "run"
    job = Launch(train_args(tiny_data, run_dir))
    assert job.wait(180) == 0, job.text
    return run_dir


@pytest.fixture(scope="module")
def source(straight):
    """A checkpoint outside the run dirs below: the straight run's step 4, as --resume PATH."""
    return straight / "checkpoints" / "step_0000004"


def assert_same_as_straight(run_dir, straight, first_step=1):
    rows, ref = read_metrics(run_dir)[0], read_metrics(straight)[0]
    # no step twice, none missing
    assert [r["step"] for r in rows] == list(range(first_step, STEPS + 1))
    for key in ("loss", "grad_norm", "lr"):
        assert [r[key] for r in rows] == [r[key] for r in ref[first_step - 1:]], key
    final = f"checkpoints/step_{STEPS:07d}"
    weights, ref_weights = saved_weights(run_dir / final), saved_weights(straight / final)
    assert all(torch.equal(weights[k], ref_weights[k]) for k in ref_weights)


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


# ---- 4: two nodes restart together --------------------------------------------------------------

def test_two_nodes_restart_after_a_worker_is_killed(straight, tiny_data, tmp_path):
    """Two launchers (--nnodes 2, c10d rendezvous on loopback, --max-restarts 1 each), as two
    nodes would run them: the second node's worker has RANK 1 and LOCAL_RANK 0 (sharding the data
    by LOCAL_RANK would change every loss). Rank 1 is SIGKILLed after step 5. Only its agent counts
    the restart (the other restarts for the membership change), so the nodes'
    TORCHELASTIC_RESTART_COUNT differ; the workers still agree on the attempt, form the group again
    and finish equal to the uninterrupted run."""
    run_dir, port = tmp_path / "run", free_port()
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                "--nproc-per-node", "1", "--max-restarts", "1", "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"127.0.0.1:{port}",
                "--rdzv-id", "two-nodes", "--monitor-interval", "0.5"]
    args = train_args(tiny_data, run_dir, nproc=0)[1:]  # "-m ddpgpt train ..."
    nodes = [Launch(launcher + args, env={"DDPGPT_FAULT": "kill@5@1", "OMP_NUM_THREADS": "1"})
             for _ in range(2)]
    try:
        codes = [n.wait(240) for n in nodes]
    finally:
        for n in nodes:
            n.kill()
    text = "\n".join(n.text for n in nodes)
    assert codes == [0, 0], text
    assert "fault: kill at step 5" in text
    # rank 0 only, per attempt
    assert text.count("ddpgpt: training on 2 processes (2 nodes × 1, gloo)") == 2
    assert f"resuming from {run_dir / 'checkpoints' / 'step_0000004'} (step 4" in text
    assert "Traceback" not in text
    assert_same_as_straight(run_dir, straight)
    killed = min(t for n in nodes for t, line in n.lines if "fault: kill at step 5" in line)
    resumed = min(t for n in nodes for t, line in n.lines if "resuming from" in line)
    print(f"\n[figure] two nodes, rank 1 SIGKILLed -> the restarted job resuming: "
          f"{resumed - killed:.1f} s")


# ---- 12: elastic membership (torchrun --nnodes 1:2) ----------------------------------------------

# The recipe of docs/reliability.md: torch 2.13's shared worker store deadlocks a node that joins,
# and a rendezvous store hosted by a training node ends the job when that node goes.
ELASTIC = ["--nnodes", "1:2", "--nproc-per-node", "1", "--max-restarts", "1",
           "--rdzv-backend", "c10d", "--rdzv-id", "elastic", "--monitor-interval", "0.5",
           "--rdzv-conf", "is_host=0,last_call_timeout=1,keep_alive_interval=1,"
                          "keep_alive_max_attempt=5"]


@pytest.fixture
def rendezvous():
    """`ddpgpt rendezvous` on a free port: the store lives outside the nodes, so any node can
    die, rank 0's included. Yields the port."""
    port = free_port()
    store = Launch([sys.executable, "-m", "ddpgpt", "rendezvous", "--host", "127.0.0.1",
                    "--port", str(port)])
    try:
        store.wait_for("ddpgpt: rendezvous store on", 60)
        yield port
    finally:
        store.kill()


def elastic_node(port: int, data: Path, run_dir: Path, fault: str, *extra) -> Launch:
    """One node of the elastic job: a torchrun agent with one worker."""
    launcher = [sys.executable, "-m", "torch.distributed.run", *ELASTIC,
                "--rdzv-endpoint", f"127.0.0.1:{port}"]
    return Launch(launcher + train_args(data, run_dir, *extra, nproc=0)[1:],
                  env={"OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
                       "DDPGPT_FAULT": fault})


def finish(nodes: list[Launch], timeout: float) -> tuple[list[int], str]:
    try:
        codes = [n.wait(timeout) for n in nodes]
    finally:
        for n in nodes:
            n.kill()
    return codes, "\n".join(n.text for n in nodes)


def first_line(nodes: list[Launch], fragment: str, after: float = 0.0) -> float:
    """When the first node printed a line holding `fragment` (at or after `after`); a missing
    line fails with what the nodes did print."""
    times = [t for n in nodes for t, line in n.lines if fragment in line and t >= after]
    assert times, f"no line with {fragment!r} after t={after:.1f}:\n" + "\n".join(
        n.text for n in nodes)
    return min(times)


def assert_close_to_straight(run_dir: Path, straight: Path, exact_until: int) -> None:
    """Every step once; losses equal the straight W=2 run's: bitwise while the group was the
    same, within 1e-5 at the other W (float rounding of another reduction order)."""
    rows, ref = read_metrics(run_dir)[0], read_metrics(straight)[0]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    losses, expected = [r["loss"] for r in rows], [r["loss"] for r in ref]
    assert losses[:exact_until] == expected[:exact_until]
    np.testing.assert_allclose(losses, expected, rtol=0, atol=1e-5)
    assert [r["lr"] for r in rows] == [r["lr"] for r in ref]


def test_a_node_lost_with_rank_0_the_other_finishes(straight, rendezvous, tiny_data, tmp_path):
    """Two nodes; the one of rank 0 (its agent and worker) is SIGKILLed after step 5 (the
    checkpoint is step 4). The survivor re-forms the group alone (W=1), takes the run dir's lock,
    resumes from step 4 without applying --reset a second time (torch's store, which counted the
    attempts, died with that node), and finishes with the straight W=2 run's losses."""
    run_dir = tmp_path / "run"
    shutil.copytree(straight, run_dir)  # something for --reset to set aside, once
    nodes = [elastic_node(rendezvous, tiny_data, run_dir, "kill-node@5@0", "--reset")
             for _ in range(2)]
    codes, text = finish(nodes, 240)
    assert sorted(codes) == [-signal.SIGKILL, 0], text
    killed = first_line(nodes, "fault: kill-node at step 5")
    resumed = first_line(nodes, f"resuming from {run_dir / 'checkpoints' / 'step_0000004'} "
                                "(step 4, saved at world size 2)", after=killed)
    training = first_line(nodes, "ddpgpt: training on 1 process,", after=resumed)
    assert len(list(run_dir.glob("reset-*"))) == 1, text
    assert "Traceback" not in next(n.text for n, c in zip(nodes, codes) if c == 0)
    assert_close_to_straight(run_dir, straight, exact_until=4)
    print(f"\n[figure] elastic 1:2, rank 0's node SIGKILLed -> the other training again at W=1: "
          f"{training - killed:.1f} s; steps lost: 5 - 4 = 1")


def test_a_node_that_joins_costs_no_step(straight, rendezvous, tiny_data, tmp_path):
    """One node trains alone (W=1) and holds after step 3 until a stop signal reaches it; a
    second node joins. The first node's agent stops its worker with SIGTERM: it finishes step 4
    and checkpoints it; the job goes on at W=2 from step 4. No step is lost or done twice, and
    the losses are the straight W=2 run's."""
    run_dir = tmp_path / "run"
    first = elastic_node(rendezvous, tiny_data, run_dir, "hold@3@0")
    nodes = [first]
    try:
        first.wait_for("fault: hold until a stop signal", 120)
        joined = time.monotonic()
        nodes.append(elastic_node(rendezvous, tiny_data, run_dir, ""))
    finally:
        codes, text = finish(nodes, 240)
    assert codes == [0, 0], text
    stop = run_dir / "checkpoints" / "step_0000004"
    assert (f"ddpgpt: stopped: at step 4 on SIGTERM; checkpoint {stop} is complete: if torchrun "
            "stopped the group for a node that joins, the new group resumes from it by itself; "
            "else run the same command to resume") in first.text
    assert f"resuming from {stop} (step 4, saved at world size 1)" in text
    training = first_line(nodes, "ddpgpt: training on 2 processes (2 nodes × 1, gloo)")
    assert_close_to_straight(run_dir, straight, exact_until=0)
    print(f"\n[figure] elastic 1:2, a node joins -> training again at W=2: "
          f"{training - joined:.1f} s after its torchrun started; steps lost: 0")

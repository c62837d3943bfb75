"""Crashes, pre-emption, stalls and non-finite values on 2 CPU processes, injected at exact steps
through DDPGPT_FAULT (see ddpgpt/faults.py). Each test checks what the job did (exit code, the one
line it printed, the checkpoints and metrics it left) and, where the job goes on, that its losses
and weights equal those of the uninterrupted run, bitwise: the session's `straight`
(tests/dist/conftest.py, shared with tests/dist/test_recovery_*.py).

The timings printed (run with -s) are the figures quoted in docs/reliability.md.
"""

import json
import shutil
import signal
import sys

import pytest
import torch

from ddpgpt.checkpoint import store
from ddpgpt.guard.health import EXIT_PREEMPTED
from tests.dist.recovery_runs import STEPS, assert_same_as_straight
from tests.helpers import read_metrics, saved_state, tiny_train_args
from tests.processes import Launch, codes, run_ranks

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]


def launch_args(data, run_dir, *extra, **overrides):
    """`python -m ddpgpt train --nproc 2 ...`: through torch's elastic launcher."""
    overrides.setdefault("run__checkpoint_every", 4)
    return [sys.executable, *tiny_train_args(data, run_dir, STEPS, **overrides), "--nproc", "2",
            *extra]


def test_sigkill_of_a_worker_restarts_and_resumes(straight, tiny_data, tmp_path):
    """Rank 1 is SIGKILLed after step 5 (checkpoint at 4): with --max-restarts 1 the group restarts,
    resumes from step 4 and finishes as if nothing had happened. One step is recomputed."""
    run_dir = tmp_path / "run"
    job = Launch(launch_args(tiny_data, run_dir, "--max-restarts", "1"),
                 env={"DDPGPT_FAULT": "kill@5@1"})
    assert job.wait(240) == 0, job.text
    killed = job.when("fault: kill at step 5")
    resumed = job.when(f"resuming from {run_dir / 'checkpoints' / 'step_0000004'} (step 4",
                       after=killed)
    assert_same_as_straight(run_dir, straight)
    print(f"\n[figure] SIGKILL of a worker -> restarted group resuming: {resumed - killed:.1f} s; "
          f"steps lost: 5 - 4 = 1; whole job {job.end - job.start:.1f} s")


def test_sigterm_to_one_rank_checkpoints_and_stops_all(straight, tiny_data, tmp_path):
    """SIGTERM reaches rank 1 only, before step 6: every rank stops after step 6 with a checkpoint
    and exit code 75; the same command then resumes from it and ends equal to the straight run."""
    run_dir = tmp_path / "run"
    job = Launch(launch_args(tiny_data, run_dir), env={"DDPGPT_FAULT": "term@5@1"})
    assert job.wait(180) == EXIT_PREEMPTED, job.text
    stop = run_dir / "checkpoints" / "step_0000006"
    assert (f"ddpgpt: stopped: at step 6 on a signal to another rank; checkpoint {stop} "
            "is complete: run the same command to resume") in job.text
    assert store.read_meta(stop)["step"] == 6
    assert [r["step"] for r in read_metrics(run_dir)[0]] == [1, 2, 3, 4, 5, 6]
    again = Launch(launch_args(tiny_data, run_dir))
    assert again.wait(180) == 0, again.text
    assert f"resuming from {stop} (step 6" in again.text
    assert_same_as_straight(run_dir, straight)


def test_sigint_to_the_launcher_is_forwarded(straight, tiny_data, tmp_path):
    """The launcher gets SIGINT (rank 0 sends it to its parent after step 3): it forwards it to the
    workers, which stop together at a step boundary with a checkpoint."""
    run_dir = tmp_path / "run"
    job = Launch(launch_args(tiny_data, run_dir), env={"DDPGPT_FAULT": "parent:INT@3"})
    code = job.wait(180)
    signaled = job.when("fault: parent:INT at step 3")
    assert code == EXIT_PREEMPTED, job.text
    stopped_at = int(job.text.split("stopped: at step ")[1].split()[0])
    assert 4 <= stopped_at < STEPS
    saved = run_dir / "checkpoints" / f"step_{stopped_at:07d}"
    line = (f"ddpgpt: stopped: at step {stopped_at} on SIGINT; checkpoint {saved} is complete: "
            "run the same command to resume")
    assert job.text.count(line) == 1 and "ddpgpt: stopped" not in job.text.replace(line, ""), \
        job.text  # one line: the launcher does not repeat what rank 0 said
    assert "closing signal" not in job.text  # the elastic agent's narration is not shown
    assert store.find_latest(run_dir / "checkpoints")[1]["step"] == stopped_at
    print(f"\n[figure] SIGINT to the launcher -> job exited with its checkpoint: "
          f"{job.end - signaled:.1f} s")
    again = Launch(launch_args(tiny_data, run_dir))
    assert again.wait(180) == 0, again.text
    assert_same_as_straight(run_dir, straight)


def test_second_signal_exits_at_once(tiny_data, tmp_path):
    """Two SIGTERMs to rank 1 (2 s apart, during step 4): it dies by the second at once, with no
    new checkpoint; rank 0 then loses its peer and exits naming the step."""
    args = tiny_train_args(tiny_data, tmp_path / "run", STEPS, run__checkpoint_every=3)
    ranks = run_ranks([args] * 2, tmp_path / "logs", env={"DDPGPT_FAULT": "term2@3@1"}, check=False)
    assert ranks[1].returncode == -signal.SIGTERM
    assert ranks[0].returncode == 1
    assert ranks[0].stderr.splitlines()[-1].startswith(
        "ddpgpt: error: step 4: a collective failed on rank 0 (")
    assert [p.name for _, p in store.step_dirs(tmp_path / "run" / "checkpoints")] == [
        "step_0000003"]


def test_stalled_rank_ends_the_job_after_the_timeout(tiny_data, tmp_path):
    """Rank 1 stops responding before step 4; with --run.dist-timeout-s 4 rank 0 gives up after
    4 s with one line naming the step, and the launcher ends the job: no hang. (The stalled rank
    takes the launcher's SIGTERM as a stop request it never reaches, so the launcher SIGKILLs it
    after its shutdown timeout, 30 s.)"""
    job = Launch(launch_args(tiny_data, tmp_path / "run", run__dist_timeout_s=4),
                 env={"DDPGPT_FAULT": "stall@3@1"})
    assert job.wait(120) == 1, job.text
    stalled = job.when("fault: stall at step 3")
    message = ("ddpgpt: error: step 4: a collective failed on rank 0 (Timed out waiting 4000ms "
               "for recv operation to complete); another rank stalled or died (see its log). "
               "Collectives wait at most run.dist_timeout_s = 4 s")
    gave_up = job.when(message)
    # Rank 0's wait can begin a moment before rank 1 announces its stall (the lines are read as
    # they come).
    assert 4 - 0.5 <= gave_up - stalled < 4 + 5
    assert job.end - stalled < 4 + 30 + 10
    print(f"\n[figure] stalled rank, timeout 4 s -> rank 0 exited {gave_up - stalled:.1f} s "
          f"after the stall, the job {job.end - stalled:.1f} s after it")


def test_a_peer_lost_during_an_fsdp2_forward_is_one_line(tiny_data, tmp_path):
    """Under fsdp2 the first collective of a step is a forward's all-gather of a block's weights,
    not the last backward's: rank 1 stalls before step 4 and rank 0's wait there ends in the same
    one line, not a traceback."""
    job = Launch(launch_args(tiny_data, tmp_path / "run", run__dist_timeout_s=4,
                             run__sync="fsdp2"), env={"DDPGPT_FAULT": "stall@3@1"})
    assert job.wait(120) == 1, job.text
    assert "Traceback" not in job.text, job.text
    assert "ddpgpt: error: step 4: a collective failed on rank 0 (" in job.text, job.text


def test_nan_on_one_rank_stops_every_rank(tiny_data, tmp_path):
    run_dir = tmp_path / "run"
    args = tiny_train_args(tiny_data, run_dir, STEPS, run__checkpoint_every=3,
                           run__on_nonfinite="stop")
    ranks = run_ranks([args] * 2, tmp_path / "logs", env={"DDPGPT_FAULT": "nan@3@1"}, check=False)
    assert codes(ranks)[0] == [1, 1], codes(ranks)[1]
    assert ranks[0].stderr.endswith(
        "ddpgpt: error: step 4: non-finite loss or gradient norm on rank 1; stopped before the "
        f"optimizer step. The checkpoint {run_dir / 'checkpoints' / 'step_0000003'} was written "
        "after the trouble began (the update before step 4 may be its cause), and a plain rerun "
        "would resume from it; no checkpoint before it is known healthy: --reset starts over; "
        "lower optim.lr or raise optim.warmup_steps, or use --on-nonfinite skip\n")
    assert ranks[1].stderr == ""
    assert [p.name for _, p in store.step_dirs(run_dir / "checkpoints")] == ["step_0000003"]
    # intact: hashes match
    assert store.read_meta(run_dir / "checkpoints" / "step_0000003")["step"] == 3
    assert [r["step"] for r in read_metrics(run_dir)[0]] == [1, 2, 3]


def test_nan_skip_and_its_limit(tiny_data, tmp_path):
    run_dir = tmp_path / "skip"
    args = tiny_train_args(tiny_data, run_dir, 6, run__checkpoint_every=0, run__on_nonfinite="skip")
    ranks = run_ranks([args] * 2, tmp_path / "logs", env={"DDPGPT_FAULT": "nan@3@1"})
    assert ("ddpgpt: warning: step 4: non-finite loss or gradient norm on rank 1; "
            "skipped (1 of at most 10)" in ranks[0].stderr)
    rows = read_metrics(run_dir)[0]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert rows[3]["loss"] is None and rows[3]["grad_norm"] is None
    assert all(r["loss"] is not None for r in rows[:3] + rows[4:])
    final = run_dir / "checkpoints" / "step_0000006"
    saved = saved_state(final)
    assert saved["guard"]["skipped"] == 1
    state = saved["optimizer"]["state"]
    assert {int(s["step"]) for s in state.values()} == {5}  # 6 steps, one without an update

    limited = tiny_train_args(tiny_data, tmp_path / "limit", 6, run__on_nonfinite="skip",
                              run__max_skipped=0)
    ranks = run_ranks([limited] * 2, tmp_path / "logs2", env={"DDPGPT_FAULT": "nan@3@1"},
                      check=False)
    assert codes(ranks)[0] == [1, 1], codes(ranks)[1]
    checkpoint_3 = tmp_path / "limit" / "checkpoints" / "step_0000003"
    assert ranks[0].stderr.endswith(
        "stopped before the optimizer step after 0 skipped steps (run.max_skipped). The "
        f"checkpoint {checkpoint_3} was written after the trouble began (the update before step "
        "4 may be its cause), and a plain rerun would resume from it; no checkpoint before it is "
        "known healthy: --reset starts over; lower optim.lr or raise optim.warmup_steps, or raise "
        "run.max_skipped\n")


def test_a_rank_lost_during_a_checkpoint_is_named_as_such(tiny_data, tmp_path):
    """Rank 1 dies while the checkpoint of step 3 is being taken: the survivor says so, rather
    than blaming step 4, which never began."""
    args = tiny_train_args(tiny_data, tmp_path / "run", STEPS, run__checkpoint_every=3)
    ranks = run_ranks([args] * 2, tmp_path / "logs", env={"DDPGPT_FAULT": "kill-saving@3@1"},
                      check=False)
    assert codes(ranks)[0] == [1, -9], codes(ranks)[1]
    last = ranks[0].stderr.splitlines()[-1]
    assert last.startswith("ddpgpt: error: the checkpoint of step 3: a collective failed on rank "
                           "0 ("), ranks[0].stderr
    assert last.endswith("another rank stalled or died (see its log). Collectives wait at most "
                         "run.dist_timeout_s = 600 s")
    assert not (tmp_path / "run" / "checkpoints" / "step_0000003").exists()


def test_ranks_must_see_the_same_dataset(tiny_data, tmp_path):
    """Same path, different contents on two 'nodes' (two working directories): refused."""
    for node, fraction in ((tmp_path / "a", "0.2"), (tmp_path / "b", "0.3")):
        node.mkdir()
        shutil.copytree(tiny_data, node / "data")
        meta = json.loads((node / "data" / "meta.json").read_text())
        meta["source"]["val_fraction"] = float(fraction)  # another preparation: another fingerprint
        (node / "data" / "meta.json").write_text(json.dumps(meta))
    args = tiny_train_args("data", tmp_path / "run")
    ranks = run_ranks([args] * 2, tmp_path / "logs", check=False,
                      cwds=[tmp_path / "a", tmp_path / "b"])
    assert codes(ranks)[0] == [1, 1], codes(ranks)[1]
    assert ranks[0].stderr == ("ddpgpt: error: ranks disagree on the dataset (meta.json): rank 1 "
                               "differs from rank 0; every node must see the same prepared "
                               "dataset in data.dir\n")


def test_doctor_probes_all_reduce(tmp_path):
    job = Launch([sys.executable, "-m", "ddpgpt", "doctor", "--nproc", "2", "--probe-mb", "4"])
    assert job.wait(120) == 0, job.text
    assert f"torch {torch.__version__}" in job.text and "backends gloo" in job.text
    line = job.text.split("all-reduce 4 MB over 2 processes (gloo, cpu): ")[1].splitlines()[0]
    ms, bandwidth = line.split(" ms, bus bandwidth ")
    assert float(ms) > 0 and float(bandwidth.removesuffix(" GB/s")) > 0
    print(f"\n[figure] gloo all-reduce probe: {line}")




def test_nodes_that_see_different_run_dirs(tiny_data, tmp_path):
    """Two 'nodes' (working directories) with a relative --run-dir: only node 0's holds the
    checkpoint. Every difference is named, the checkpoint first, not just the weights it causes."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    args = tiny_train_args(tiny_data, "run", 2)
    r = run_ranks([args], tmp_path / "logs0", cwds=[tmp_path / "a"])  # node 0 alone trains 2 steps
    args = tiny_train_args(tiny_data, "run", 4)
    ranks = run_ranks([args] * 2, tmp_path / "logs", check=False,
                      cwds=[tmp_path / "a", tmp_path / "b"])
    assert codes(ranks)[0] == [1, 1], codes(ranks)[1]
    assert ranks[0].stderr.splitlines()[-1] == (
        "ddpgpt: error: ranks disagree on the checkpoint to resume from: rank 1 differs from "
        "rank 0; put the run dir on a filesystem that every node shares; and on the resolved "
        "config: rank 1 differs from rank 0; start every rank with the same command line and "
        "config file; and on the parameters before training: rank 1 differs from rank 0; every "
        "rank must build the model from the same seed (run.seed); do not seed ranks differently "
        "before init")  # the config too: the schedule's length comes from the checkpoint
    assert ranks[1].stderr == "" and r[0].returncode == 0

"""Recovery paths of several launchers as nodes that must not lose progress: two nodes that
restart; an elastic job that loses a node (rank 0's) or gains one. Each test reproduces one way
these went wrong (see the table in docs/reliability.md) with the real command line on 2 CPU
processes, faults injected through DDPGPT_FAULT at exact steps. One launcher:
tests/dist/test_recovery_one_node.py.

The timings printed (run with -s) are the figures quoted in docs/reliability.md.
"""

from __future__ import annotations

import shutil
import signal
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.dist.recovery_runs import STEPS, assert_same_as_straight, train_args
from tests.helpers import read_metrics
from tests.processes import Launch, free_port

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]


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

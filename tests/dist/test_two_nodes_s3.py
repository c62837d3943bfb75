"""Two nodes that share nothing: two torchrun agents on this machine (--nnodes 2, c10d rendezvous
on loopback), each with its own local run dir and no common path; the dataset in S3 and the
checkpoints to S3 (a real server: moto's, tests/s3.py). One node is SIGKILLed mid-run; the job
goes on from the URL alone, first as one process on a third machine (W=1), then as two new
nodes (W=2), and every step's loss is the uninterrupted run's: the session's straight run
(tests/dist/conftest.py: the same config and data, read from a local dir, at W=2)."""

from __future__ import annotations

import signal
import sys

import numpy as np
import pytest

from tests.helpers import read_metrics, tiny_train_args
from tests.processes import Launch, free_port, run_cli

pytestmark = [pytest.mark.dist, pytest.mark.timeout(420)]
STEPS = 8


def args(data, run_dir, steps=STEPS, *extra):
    return tiny_train_args(data, run_dir, steps, optim__decay_steps=STEPS,
                           run__checkpoint_every=2)[1:] + [str(x) for x in extra]


def nodes(data, url, dirs, fault=""):
    """Two agents, one worker each, a fresh rendezvous; each its own run dir."""
    port = free_port()
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                "--nproc-per-node", "1", "--max-restarts", "0", "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"job{port}",
                "--monitor-interval", "0.5"]
    return [Launch(launcher + ["-m"] + args(data, d, STEPS, "--run.checkpoint-url", url),
                   env={"DDPGPT_FAULT": fault, "OMP_NUM_THREADS": "1"}) for d in dirs]


def finish(jobs, timeout=240):
    try:
        return [j.wait(timeout) for j in jobs], "\n".join(j.text for j in jobs)
    finally:
        for j in jobs:
            j.kill()


def losses(*run_dirs) -> dict[int, float]:
    """Each step's loss as the last run that logged it has it."""
    out = {}
    for d in run_dirs:
        if (d / "metrics.jsonl").is_file():
            out.update({r["step"]: r["loss"] for r in read_metrics(d)[0]})
    return out


def test_two_nodes_without_a_shared_filesystem_lose_one_and_go_on(s3, s3_data, straight,
                                                                  tmp_path):
    expected = losses(straight)  # the session's (tests/dist/conftest.py): these 8 steps at W=2
    url = s3.bucket("nodes") + "/run"

    first = [tmp_path / "node-a" / "run", tmp_path / "node-b" / "run"]
    codes, text = finish(nodes(s3_data, url, first, fault="kill-node@5@1"))
    assert "fault: kill-node at step 5" in text and -signal.SIGKILL in codes, text
    assert sorted(p.rsplit("/", 1)[-1] for p in s3.fs().ls(url[5:]) if "step_" in p) == \
        ["step_0000002", "step_0000004"]  # step 4's checkpoint, whole, in S3 alone
    before = losses(*first)
    assert [before[s] for s in range(1, 5)] == [expected[s] for s in range(1, 5)]  # bitwise

    third = tmp_path / "node-c" / "run"  # another machine, nothing local: W=1 to step 6
    out = run_cli("train", "--run-dir", third, "--run.checkpoint-url", url, "--run.steps", "6",
                  "--run.threads", "1", "--nproc", "1", timeout=200)
    assert out.returncode == 0, out.stderr
    assert f"resuming from {url}/step_0000004 (step 4, saved at world size 2)" in out.stderr

    last = [tmp_path / "node-d" / "run", tmp_path / "node-e" / "run"]  # two new nodes: W=2
    codes, text = finish(nodes(s3_data, url, last))
    assert codes == [0, 0], text
    assert f"resuming from {url}/step_0000006 (step 6, saved at world size 1)" in text
    after = losses(third, *last)
    assert sorted(after) == list(range(1, 9))  # steps 1-4 from the URL's metrics (run/logs.py)
    assert [after[s] for s in range(1, 5)] == [before[s] for s in range(1, 5)]
    np.testing.assert_allclose([after[s] for s in range(5, 9)],
                               [expected[s] for s in range(5, 9)], rtol=0, atol=1e-5)
    assert "Traceback" not in out.stderr

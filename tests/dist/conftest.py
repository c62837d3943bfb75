"""Fixtures shared by the files of tests/dist: one thread in the tests' own process, and the
uninterrupted run (built once a session, on each pytest worker that needs it) that
test_recovery_one_node.py, test_recovery_nodes.py, test_reliability.py, test_equivalence.py,
test_toy_mode.py and test_two_nodes_s3.py compare with and test_resume.py resumes a copy of."""

from __future__ import annotations

import pytest
import torch

from tests.dist.recovery_runs import train_args
from tests.processes import Launch


@pytest.fixture(autouse=True)
def one_thread():
    """What a test computes in its own process (a one-process oracle, a checkpoint read back) on
    one thread, as the ranks it launches run (OMP_NUM_THREADS=1, run.threads 1): tensors this
    small gain nothing from a second thread, and where the other core is busy (pytest -n 2) its
    barrier costs many times the work (the one-process evaluation of test_collectives.py: 17.5
    CPU s on 2 threads, 1.8 on one, under load)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def straight(tiny_data, tmp_path_factory):
    """The uninterrupted reference: 8 steps at W=2, checkpoints every 2 steps (the last 3 kept)."""
    run_dir = tmp_path_factory.mktemp("straight") / "run"
    job = Launch(train_args(tiny_data, run_dir))
    assert job.wait(180) == 0, job.text
    return run_dir

"""Fixtures shared by several files of tests/dist: the uninterrupted run that
tests/dist/test_recovery_one_node.py, test_recovery_nodes.py and test_reliability.py compare
with, and test_resume.py resumes from a copy of (built once a session)."""

from __future__ import annotations

import pytest

from tests.dist.recovery_runs import train_args
from tests.helpers import Launch


@pytest.fixture(scope="session")
def straight(tiny_data, tmp_path_factory):
    """The uninterrupted reference: 8 steps at W=2, checkpoints every 2 steps (the last 3 kept)."""
    run_dir = tmp_path_factory.mktemp("straight") / "run"
    job = Launch(train_args(tiny_data, run_dir))
    assert job.wait(180) == 0, job.text
    return run_dir

"""A new sync mode is its file and its row: tests/dist/toy_sync.py adds both from outside the
package, and `ddpgpt train --run.sync toy` at W=2 trains step for step like ddp (at W=2 a sum
then one division rounds like DDP's; tests/dist/test_sync.py measured every built-in mode bitwise
equal there, and allows 1e-6)."""

import json

import numpy as np
import pytest

from tests.dist.recovery_runs import STEPS, train_args
from tests.helpers import REPO, read_metrics
from tests.processes import run_ranks

pytestmark = [pytest.mark.dist, pytest.mark.timeout(240)]


def test_a_mode_added_from_outside_trains_like_ddp(straight, tmp_path, tiny_data):
    """The toy mode's run against the session's straight run (tests/dist/conftest.py: ddp at W=2,
    the same config and steps)."""
    run_dir = tmp_path / "toy"
    args = train_args(tiny_data, run_dir, nproc=0, run__sync="toy", run__checkpoint_every=0)
    args[2] = "tests.dist.toy_sync"  # -m tests.dist.toy_sync train ...: the row, then ddpgpt
    run_ranks([args[1:]] * 2, tmp_path / "logs-toy", timeout=200)
    assert json.loads((run_dir / "config.json").read_text())["run"]["sync"] == "toy"
    assert json.loads((straight / "config.json").read_text())["run"]["sync"] == "ddp"
    toy, ddp = ([r["loss"] for r in read_metrics(d)[0]] for d in (run_dir, straight))
    assert len(toy) == STEPS
    np.testing.assert_allclose(toy, ddp, rtol=1e-6, atol=0)


def test_the_package_does_not_know_the_toy_mode():
    """Nothing under ddpgpt/ names it: the file and the row are all there is."""
    assert not [p for p in (REPO / "ddpgpt").rglob("*.py") if "toy" in p.read_text()]

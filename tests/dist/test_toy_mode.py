"""A new sync mode is its file and its row: tests/dist/toy_sync.py adds both from outside the
package, and `ddpgpt train --run.sync toy` at W=2 trains step for step like ddp (at W=2 a sum
then one division rounds like DDP's; tests/dist/test_sync.py measured every built-in mode bitwise
equal there, and allows 1e-6)."""

import json

import numpy as np
import pytest

from tests.helpers import REPO, read_metrics, run_ranks, tiny_train_args

pytestmark = [pytest.mark.dist, pytest.mark.timeout(240)]


def train(tmp_path, tiny_data, mode: str) -> list[float]:
    run_dir = tmp_path / mode
    args = tiny_train_args(tiny_data, run_dir, steps=4, run__sync=mode, run__checkpoint_every=0)
    args[1] = "tests.dist.toy_sync"  # -m tests.dist.toy_sync train ...: the row, then ddpgpt
    run_ranks([args] * 2, tmp_path / f"logs-{mode}", timeout=200)
    assert json.loads((run_dir / "config.json").read_text())["run"]["sync"] == mode
    return [r["loss"] for r in read_metrics(run_dir)[0]]


def test_a_mode_added_from_outside_trains_like_ddp(tmp_path, tiny_data):
    toy, ddp = train(tmp_path, tiny_data, "toy"), train(tmp_path, tiny_data, "ddp")
    assert len(toy) == 4
    np.testing.assert_allclose(toy, ddp, rtol=1e-6, atol=0)


def test_the_package_does_not_know_the_toy_mode():
    """Nothing under ddpgpt/ names it: the file and the row are all there is."""
    assert not [p for p in (REPO / "ddpgpt").rglob("*.py") if "toy" in p.read_text()]

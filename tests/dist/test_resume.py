"""Exact resume: n straight steps == k steps + resume + n-k steps.

The straight run is the session's (tests/dist/conftest.py): 8 steps at W=2, checkpoints every 2
steps, the last 3 kept (4, 6, 8). A copy of its run dir without the checkpoints of steps 6 and 8
resumes from step 4 (as after a crash), at W=2 (bitwise equal: weights, optimizer state, losses,
gradient norms) and at W=1 with A doubled (equal within the equivalence tolerances: the data is
the same, only the order of float sums differs).
"""

import shutil

import numpy as np
import pytest
import torch

from tests.dist.recovery_runs import STEPS, train_args
from tests.helpers import read_metrics, saved_state
from tests.processes import run_ranks

pytestmark = [pytest.mark.dist, pytest.mark.timeout(240)]
K = 4


def resumed(straight, tiny_data, tmp_path, W):
    run_dir = tmp_path / "run"
    shutil.copytree(straight, run_dir)
    for step in range(K + 1, STEPS + 1):
        shutil.rmtree(run_dir / "checkpoints" / f"step_{step:07d}", ignore_errors=True)
    args = train_args(tiny_data, run_dir, nproc=0)[1:]  # "-m ddpgpt train ...", as each rank runs
    results = run_ranks([args] * W, tmp_path / "logs")
    assert (f"resuming from {run_dir / 'checkpoints' / f'step_{K:07d}'} "
            f"(step {K}, saved at world size 2)" in results[0].stderr)
    return run_dir
def final(run_dir):
    path = run_dir / "checkpoints" / f"step_{STEPS:07d}"
    state = saved_state(path)
    return state["model"], state


def test_resume_same_world_size_is_bitwise(straight, tiny_data, tmp_path):
    run_dir = resumed(straight, tiny_data, tmp_path, W=2)
    rows, ref_rows = read_metrics(run_dir)[0], read_metrics(straight)[0]
    # cut back to 4, then 5..8 once each
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for key in ("loss", "grad_norm", "lr", "tokens"):
        assert [r[key] for r in rows] == [r[key] for r in ref_rows], key
    (weights, state), (ref_weights, ref_state) = final(run_dir), final(straight)
    for name in ref_weights:
        assert torch.equal(weights[name], ref_weights[name]), name
    for pid, slots in ref_state["optimizer"]["state"].items():
        for slot, value in slots.items():
            assert torch.equal(state["optimizer"]["state"][pid][slot], value), (pid, slot)
    assert torch.equal(state["rng"]["cpu"], ref_state["rng"]["cpu"])


def test_resume_at_another_world_size(straight, tiny_data, tmp_path):
    run_dir = resumed(straight, tiny_data, tmp_path, W=1)
    rows, ref_rows = read_metrics(run_dir)[0], read_metrics(straight)[0]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    # rows before the resume kept
    assert [r["loss"] for r in rows[:K]] == [r["loss"] for r in ref_rows[:K]]
    np.testing.assert_allclose([r["loss"] for r in rows], [r["loss"] for r in ref_rows], rtol=2e-5)
    weights, ref_weights = final(run_dir)[0], final(straight)[0]
    for name in ref_weights:
        torch.testing.assert_close(weights[name], ref_weights[name], rtol=0, atol=5e-5, msg=name)

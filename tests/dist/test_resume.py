"""Exact resume: n straight steps == k steps + resume + n-k steps.

The straight run trains 6 steps at W=2 with checkpoints at 3 and 6. A copy of its run dir without
the step-6 checkpoint resumes from step 3 (as after a crash), at W=2 (bitwise equal: weights,
optimizer state, losses, gradient norms) and at W=1 with A doubled (equal within the equivalence
tolerances: the data is the same, only the order of float sums differs).
"""

import shutil

import numpy as np
import pytest
import torch

from tests.helpers import read_metrics, run_ranks, saved_state, tiny_train_args

pytestmark = [pytest.mark.dist, pytest.mark.timeout(240)]
STEPS, K = 6, 3


@pytest.fixture(scope="module")
def straight(tiny_data, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("straight") / "run"
    run_ranks([tiny_train_args(tiny_data, run_dir, STEPS)] * 2, run_dir.parent / "logs")
    return run_dir


def resumed(straight, tiny_data, tmp_path, W):
    run_dir = tmp_path / "run"
    shutil.copytree(straight, run_dir)
    shutil.rmtree(run_dir / "checkpoints" / f"step_{STEPS:07d}")
    results = run_ranks([tiny_train_args(tiny_data, run_dir, STEPS)] * W, tmp_path / "logs")
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
    # cut back to 3, then 4..6 once each
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

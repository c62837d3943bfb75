"""What the tests of tests/dist/test_recovery_*.py share: the tiny model's command line for 8
steps on 2 processes, and the comparison of a run with the uninterrupted one (the `straight`
fixture of tests/dist/conftest.py)."""

from __future__ import annotations

import sys

import torch

from tests.helpers import read_metrics, saved_weights, tiny_train_args

STEPS = 8


def train_args(data, run_dir, *extra, nproc=2, **overrides):
    """`python -m ddpgpt train` of the tiny model, `--nproc 2` by default."""
    overrides.setdefault("run__checkpoint_every", 2)
    launch = ["--nproc", str(nproc)] if nproc else []
    return [sys.executable, *tiny_train_args(data, run_dir, STEPS, **overrides), *launch, *extra]


def assert_same_as_straight(run_dir, straight, first_step=1):
    rows, ref = read_metrics(run_dir)[0], read_metrics(straight)[0]
    # no step twice, none missing
    assert [r["step"] for r in rows] == list(range(first_step, STEPS + 1))
    for key in ("loss", "grad_norm", "lr"):
        assert [r[key] for r in rows] == [r[key] for r in ref[first_step - 1:]], key
    final = f"checkpoints/step_{STEPS:07d}"
    weights, ref_weights = saved_weights(run_dir / final), saved_weights(straight / final)
    assert all(torch.equal(weights[k], ref_weights[k]) for k in ref_weights)

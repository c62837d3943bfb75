"""Loss spikes roll back (spike.py): faults make one rank's loss 1000 times larger on an exact
global batch (`spike@5`: the batch a straight run's step 6 reads) or at an exact step every time
it runs (`diverge@5`). The oracle is the plain-PyTorch reference training of tests/helpers.py fed
the batches the loader's documented order gives once the spike's are skipped, at the lowered lr.

The runs share one config: 10 steps, a checkpoint every 3, spikes looked for against the median
of the last 3 steps, the lr halved for 6 steps after a rollback. A spike at step 6 rolls back to
step 3 and skips global batches 3, 4 and 5 (windows 24-47 of epoch 0's order); steps 4-10 then
read batches 6-12, steps 4-9 at half the lr.
"""

import json

import numpy as np
import pytest
import torch

from ddpgpt.config import OptimConfig
from ddpgpt.optim import lr_at
from ddpgpt.reliability import EXIT_PREEMPTED
from tests.helpers import (
    codes,
    read_metrics,
    reference_training,
    run_ranks,
    saved_state,
    saved_weights,
    tiny_train_args,
)

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]
STEPS, G = 10, 8
SETTINGS = {"run__checkpoint_every": 3, "run__spike_window": 3, "run__rollback_lr_steps": 6}
BATCHES = [0, 1, 2, 6, 7, 8, 9, 10, 11, 12]  # the batches of steps 4-6 (3, 4, 5) skipped
LR_SCALE = [1.0] * 3 + [0.5] * 6 + [1.0]      # steps 4-9 (3 + 6) at half the lr
LOSS_TOL = 2e-5  # as tests/dist/test_equivalence.py: the order of float sums differs


def spike_run(data, run_dir, W: int, fault: str, check: bool = True, **overrides):
    args = tiny_train_args(data, run_dir, STEPS, **{**SETTINGS, **overrides})
    return run_ranks([args] * W, run_dir.parent / f"logs-{run_dir.name}",
                     env={"DDPGPT_FAULT": fault}, check=check)


def events(run_dir) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r.get("event") == "rollback"]


@pytest.fixture(scope="module")
def runs(tiny_data, tmp_path_factory):
    """The same bad batch at W=1 and at W=2 (there on rank 1 only)."""
    out = {}
    for W, fault in ((1, "spike@5"), (2, "spike@5@1")):
        run_dir = tmp_path_factory.mktemp(f"w{W}") / "run"
        out[W] = run_dir, spike_run(tiny_data, run_dir, W, fault)
    return out


def test_a_spike_rolls_back_once_past_exactly_its_batches(runs, tiny_data):
    run_dir, results = runs[1]
    (event,) = events(run_dir)
    straight, _ = reference_training(tiny_data, STEPS)  # without the spike
    assert {k: v for k, v in event.items() if k not in ("spike_loss", "median")} == {
        "step": 3, "event": "rollback", "spike_step": 6, "nonfinite_ranks": [],
        "checkpoint": str(run_dir / "checkpoints" / "step_0000003"), "checkpoint_step": 3,
        "skipped_batches": 3, "skipped_windows": [{"epoch": 0, "start": 3 * G, "end": 6 * G}],
        "lr_factor": 0.5, "lr_until_step": 9, "rollbacks": 1}
    assert event["spike_loss"] == pytest.approx(1000 * straight[5], rel=LOSS_TOL)
    assert event["median"] == pytest.approx(straight[3], rel=LOSS_TOL)  # of steps 3-5: falling
    warnings = [line for line in results[0].stderr.splitlines() if "warning" in line]
    assert warnings == [
        f"ddpgpt: warning: step 6: loss spike: {event['spike_loss']:.4g} is above 2 × the median "
        f"{event['median']:.4g} of the last 3 steps; rolling back to step 3 (step_0000003), "
        "skipping the 3 global batches read after it (steps 4-6), lr × 0.5 for 6 steps (rollback "
        "1 of at most 3 within 100 steps)"]
    # the run finished: every step once, on the batches and lr the oracle was given
    rows = read_metrics(run_dir)[0]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    expected, _ = reference_training(tiny_data, STEPS, batches=BATCHES, lr_scale=LR_SCALE)
    np.testing.assert_allclose([r["loss"] for r in rows], expected, rtol=LOSS_TOL, atol=0)
    schedule = OptimConfig(lr=1e-2, warmup_steps=2)
    assert [r["lr"] for r in rows] == pytest.approx(
        [lr_at(k, schedule, STEPS) * LR_SCALE[k] for k in range(STEPS)], rel=1e-12)
    assert expected[3] != pytest.approx(straight[3], rel=1e-3)  # other data: a real difference


def test_the_same_rollback_at_w1_and_w2(runs):
    (run1, _), (run2, _) = runs[1], runs[2]
    rows1, rows2 = read_metrics(run1)[0], read_metrics(run2)[0]
    assert [r["step"] for r in rows2] == [r["step"] for r in rows1]
    np.testing.assert_allclose([r["loss"] for r in rows2], [r["loss"] for r in rows1],
                               rtol=LOSS_TOL, atol=0)
    same = ("step", "spike_step", "checkpoint_step", "skipped_batches", "skipped_windows",
            "lr_factor", "lr_until_step", "rollbacks")
    (event1,), (event2,) = events(run1), events(run2)
    assert {k: event2[k] for k in same} == {k: event1[k] for k in same}
    assert event2["median"] == pytest.approx(event1["median"], rel=LOSS_TOL)


def test_a_run_resumed_after_a_rollback_goes_on_bitwise(runs, tiny_data, tmp_path):
    """The same command, stopped by SIGTERM after step 8 (after the rollback), then run again:
    the same losses as the uninterrupted run, rollback included, and the same final weights.
    The checkpoint carries the rollback: its record and the lowered-lr window (to step 9)."""
    run_dir = tmp_path / "run"
    stopped = spike_run(tiny_data, run_dir, 1, "spike@5,term@7", check=False)
    assert codes(stopped)[0] == [EXIT_PREEMPTED], codes(stopped)[1]
    saved = saved_state(run_dir / "checkpoints" / "step_0000008")
    assert saved["spike"]["rollbacks"] == [{"step": 6, "to": 3, "batches": 3}]
    assert saved["spike"]["lr_until"] == 9
    spike_run(tiny_data, run_dir, 1, "")
    reference, _ = runs[1]
    rows, ref = read_metrics(run_dir)[0], read_metrics(reference)[0]
    for key in ("step", "loss", "grad_norm", "lr"):
        assert [r[key] for r in rows] == [r[key] for r in ref], key
    ((event,), (ref_event,)) = events(run_dir), events(reference)
    assert {**event, "checkpoint": None} == {**ref_event, "checkpoint": None}
    final = f"checkpoints/step_{STEPS:07d}"
    weights, ref_weights = saved_weights(run_dir / final), saved_weights(reference / final)
    assert all(torch.equal(weights[k], ref_weights[k]) for k in ref_weights)


def test_the_rollback_limit_stops_the_run_in_one_line(tiny_data, tmp_path):
    """A spike that skipping data does not cure (every time step 6 runs) with
    run.max_rollbacks = 2: two rollbacks to step 3, the second skipping every batch read since
    that checkpoint (those the first skipped too), then the run stops at the third spike in one
    line, with checkpoint 3 as the last."""
    run_dir = tmp_path / "run"
    (result,) = spike_run(tiny_data, run_dir, 1, "diverge@5", check=False, run__max_rollbacks=2)
    assert result.returncode == 1, result.stderr
    lines = result.stderr.splitlines()
    assert [line.split("; ")[1] for line in lines if "warning: step 6: loss spike" in line] == [
        "rolling back to step 3 (step_0000003), skipping the 3 global batches read after it "
        "(steps 4-6), lr × 0.5 for 6 steps (rollback 1 of at most 2 within 100 steps)",
        "rolling back to step 3 (step_0000003), skipping the 6 global batches read after it, "
        "lr × 0.5 for 6 steps (rollback 2 of at most 2 within 100 steps)"]
    assert [(e["skipped_batches"], e["skipped_windows"]) for e in events(run_dir)] == [
        (3, [{"epoch": 0, "start": 3 * G, "end": 6 * G}]),
        (6, [{"epoch": 0, "start": 3 * G, "end": 9 * G}])]
    errors = [line for line in lines if line.startswith("ddpgpt: error:")]
    assert len(errors) == 1 and errors[0] == lines[-1], result.stderr
    assert errors[0].startswith("ddpgpt: error: step 6: loss spike: ")
    assert errors[0].endswith(
        "; stopped before the optimizer step after 2 rollbacks within 100 steps "
        "(run.max_rollbacks = 2). The last checkpoint (step 3) is intact; lower optim.lr or "
        "raise optim.warmup_steps, or raise run.max_rollbacks")
    assert "Traceback" not in result.stderr
    assert [r["step"] for r in read_metrics(run_dir)[0]] == [1, 2, 3, 4, 5]

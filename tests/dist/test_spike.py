"""Loss spikes under run.on_spike = recover (spike.py), end to end. Faults make the cause exact:
`spike@5` multiplies one rank's loss on global batch 5 by 1000 (bad data: its gradient is normal,
and the probe of the weights on batch 4 is not touched); `weights@5` multiplies every loss from
step 6 on by 1000, the probe's too, until the run rolls back (weights that look broken on every
batch and do not heal); `weights-always@5` never stops. The oracle is the plain-PyTorch reference
training of tests/helpers.py, fed the batches and learning rates the documented policy gives.

The runs share one config: 10 steps, a checkpoint every 3, spikes looked for against the median
of the last 3 healthy steps, a spike caused by the weights trained through for 2 steps.
"""

import json

import numpy as np
import pytest
import torch

from ddpgpt.config.optim import OptimConfig
from ddpgpt.guard.health import EXIT_PREEMPTED, EXIT_UNHEALTHY
from ddpgpt.optim.schedule import lr_at
from tests.helpers import (
    read_metrics,
    reference_training,
    saved_state,
    saved_weights,
    tiny_train_args,
)
from tests.processes import codes, run_ranks

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]
STEPS, G = 10, 8
SETTINGS = {"run__checkpoint_every": 3, "run__spike_window": 3, "run__spike_patience": 2}
# weights@5: steps 6-7 trained through, step 8 rolls back to checkpoint 3 (4 = 6 - 2 is the
# newest healthy step; 6 holds the cause) past batches 3-7; steps 4-10 read 8-14 at half the lr
BATCHES = [0, 1, 2, 8, 9, 10, 11, 12, 13, 14]
LR_SCALE = [1.0] * 3 + [0.5] * 7
LOSS_TOL = 2e-5  # as tests/dist/test_equivalence.py: the order of float sums differs


def spike_run(data, run_dir, W: int, fault: str, check: bool = True, **overrides):
    args = tiny_train_args(data, run_dir, STEPS, **{**SETTINGS, **overrides})
    return run_ranks([args] * W, run_dir.parent / f"logs-{run_dir.name}",
                     env={"DDPGPT_FAULT": fault}, check=check)


def events(run_dir, kind: str | None = None) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "event" in r and kind in (None, r["event"])]


def warnings(result) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("ddpgpt: warning")]


@pytest.fixture(scope="module")
def runs(tiny_data, tmp_path_factory):
    """Bad data and broken weights, each at W=1 and at W=2 (bad data on rank 1 only; broken
    weights on both ranks, as every rank holds the same weights)."""
    out = {}
    for name, W, fault in (("data", 1, "spike@5"), ("data", 2, "spike@5@1"),
                           ("weights", 1, "weights@5"), ("weights", 2, "weights@5@0,weights@5@1")):
        run_dir = tmp_path_factory.mktemp(f"{name}{W}") / "run"
        out[name, W] = run_dir, spike_run(tiny_data, run_dir, W, fault)
    return out


def test_a_spike_from_bad_data_skips_that_update_and_nothing_else(runs, tiny_data):
    run_dir, results = runs["data", 1]
    (event,) = events(run_dir)
    straight, _ = reference_training(tiny_data, STEPS)
    assert {k: v for k, v in event.items() if k not in ("spike_loss", "median", "probe_loss")} \
        == {"step": 6, "event": "skip", "spike_step": 6, "nonfinite_ranks": [], "cause": "data"}
    assert event["spike_loss"] == pytest.approx(1000 * straight[5], rel=LOSS_TOL)
    # the probe: the weights after step 5 on batch 4, the newest healthy step's (lower than the
    # loss step 5 saw, before its own update)
    assert event["probe_loss"] < straight[4] and event["probe_loss"] < 2 * event["median"]
    assert warnings(results[0]) == [
        f"ddpgpt: warning: step 6: loss spike: {event['spike_loss']:.4g} is above 2 × the median "
        f"{event['median']:.4g} of the last 3 steps; the weights still give "
        f"{event['probe_loss']:.4g} on the last healthy batch, so the data is the cause: this "
        "step's update is skipped"]
    # a healthy end says the step it did not train, before the next commands
    assert results[0].stderr.splitlines()[-2:-1] == [
        "ddpgpt: note: 1 of the run's 10 steps skipped their update (1 whose batch spiked: the "
        "data)"]
    rows = read_metrics(run_dir)[0]
    expected, _ = reference_training(tiny_data, STEPS, skip=(5,))  # no update at step 6
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    losses = [r["loss"] for r in rows]
    np.testing.assert_allclose(losses[:5] + losses[6:], expected[:5] + expected[6:],
                               rtol=LOSS_TOL, atol=0)
    assert expected[6] != pytest.approx(straight[6], rel=1e-4)  # the skip made a difference


def test_broken_weights_are_trained_through_then_rolled_back_to_a_healthy_checkpoint(
        runs, tiny_data):
    run_dir, results = runs["weights", 1]
    rollback, recovered = events(run_dir)  # the spike's own event went with the steps it undid
    first = warnings(results[0])[0]
    assert first.startswith("ddpgpt: warning: step 6: loss spike: ") and first.endswith(
        "on the last healthy batch too: training on through it (up to 2 steps before a rollback)")
    assert {k: v for k, v in rollback.items() if k not in ("spike_loss", "median")} == {
        "step": 3, "event": "rollback", "spike_step": 8, "first_step": 6, "nonfinite_ranks": [],
        "checkpoint": str(run_dir / "checkpoints" / "step_0000003"), "checkpoint_step": 3,
        "skipped_batches": 5, "skipped_windows": [{"epoch": 0, "start": 3 * G, "end": 8 * G}],
        "lr_factor": 0.5, "rollbacks": 1}
    assert warnings(results[0])[1] == (
        f"ddpgpt: warning: step 8: loss spike: {rollback['spike_loss']:.4g} is above 2 × the "
        f"median {rollback['median']:.4g} of the last 3 steps (the spike began at step 6); "
        "rolling back to step 3 (step_0000003), skipping the 5 global batches read after it "
        "(steps 4-8), the lr × 0.5 from now on (rollback 1 of at most 3 within 100 steps); the "
        f"later checkpoints are in {next(run_dir.glob('rollback-*'))}")
    # recovered: at step 6, where the spike began, the rolled-back run is back near the median
    # before it (at most 1.1 ×); the run ends healthy, exit 0 (run_ranks checked it)
    assert {k: v for k, v in recovered.items() if k not in ("loss_now", "bound")} == {
        "step": 6, "event": "recovered", "spike_step": 6, "median": rollback["median"]}
    assert recovered["loss_now"] <= recovered["bound"] == pytest.approx(1.1 * rollback["median"])
    assert warnings(results[0])[2] == (
        f"ddpgpt: warning: step 6: recovered: the loss {recovered['loss_now']:.4g} is back near "
        f"the median {rollback['median']:.4g} before the spike at step 6 (at most "
        f"{recovered['bound']:.4g}), after 1 rollback")
    assert "unhealthy" not in results[0].stderr and "ddpgpt: next: " in results[0].stderr
    # the run finished: every step once, on the batches and lr the oracle was given
    rows = read_metrics(run_dir)[0]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    expected, _ = reference_training(tiny_data, STEPS, batches=BATCHES, lr_scale=LR_SCALE)
    np.testing.assert_allclose([r["loss"] for r in rows], expected, rtol=LOSS_TOL, atol=0)
    schedule = OptimConfig(lr=1e-2, warmup_steps=2)
    assert [r["lr"] for r in rows] == pytest.approx(
        [lr_at(k, schedule, STEPS) * LR_SCALE[k] for k in range(STEPS)], rel=1e-12)


@pytest.mark.parametrize("name", ["data", "weights"])
def test_the_same_at_w1_and_w2(runs, name):
    (run1, _), (run2, _) = runs[name, 1], runs[name, 2]
    rows1, rows2 = read_metrics(run1)[0], read_metrics(run2)[0]
    assert [r["step"] for r in rows2] == [r["step"] for r in rows1]
    keep = [k for k in range(STEPS) if not (name == "data" and k == 5)]  # rank 1's 1000× only
    np.testing.assert_allclose([rows2[k]["loss"] for k in keep], [rows1[k]["loss"] for k in keep],
                               rtol=LOSS_TOL, atol=0)
    exact = ("step", "event", "spike_step", "cause", "checkpoint_step", "skipped_batches",
             "skipped_windows", "lr_factor", "rollbacks")
    assert [{k: e[k] for k in exact if k in e} for e in events(run2)] == \
        [{k: e[k] for k in exact if k in e} for e in events(run1)]


def test_a_run_resumed_after_a_rollback_goes_on_bitwise(runs, tiny_data, tmp_path):
    """The same command, stopped by SIGTERM after step 8 (after the rollback), then run again:
    the same losses as the uninterrupted run, rollback included, and the same final weights.
    The checkpoint carries the rollback: its record and the lowered lr."""
    run_dir = tmp_path / "run"
    stopped = spike_run(tiny_data, run_dir, 1, "weights@5,term@8", check=False)
    assert codes(stopped)[0] == [EXIT_PREEMPTED], codes(stopped)[1]
    saved = saved_state(run_dir / "checkpoints" / "step_0000009")["guard"]["spike"]
    assert (saved["rollbacks"], saved["lr_factor"]) == ([{"step": 8, "to": 3, "batches": 5}],
                                                        0.5)
    assert events(run_dir, "stop")[0]["message"].startswith("at step 9 on SIGTERM; checkpoint ")
    spike_run(tiny_data, run_dir, 1, "")
    reference, _ = runs["weights", 1]
    rows, ref = read_metrics(run_dir)[0], read_metrics(reference)[0]
    for key in ("step", "loss", "grad_norm", "lr"):
        assert [r[key] for r in rows] == [r[key] for r in ref], key
    strip = ("checkpoint", "message")
    assert [{k: v for k, v in e.items() if k not in strip} for e in events(run_dir)
            if e["event"] != "stop"] == \
        [{k: v for k, v in e.items() if k not in strip} for e in events(reference)]
    final = f"checkpoints/step_{STEPS:07d}"
    weights, ref_weights = saved_weights(run_dir / final), saved_weights(reference / final)
    assert all(torch.equal(weights[k], ref_weights[k]) for k in ref_weights)


def test_rollbacks_that_do_not_help_compound_and_then_the_run_trains_on(tiny_data, tmp_path):
    """Weights broken every time the run passes step 5, run.max_rollbacks = 2: two rollbacks to
    checkpoint 3 (no older one to go further back to), the lr halved each time, then the run
    trains on through the spike and finishes: it never stops for a finite spike. But it never
    recovered, and its end says so: an event, one line, exit 3."""
    run_dir = tmp_path / "run"
    (result,) = spike_run(tiny_data, run_dir, 1, "weights-always@5", check=False,
                          run__max_rollbacks=2)
    assert result.returncode == EXIT_UNHEALTHY, result.stderr
    (ended,) = events(run_dir, "unhealthy")
    assert (ended["step"], ended["why"], ended["spike_step"]) == (STEPS, "not recovered", 6)
    assert ended["loss_median"] > 1000 * ended["median"] / 2  # the fault's 1000 ×
    assert result.stderr.splitlines()[-1].startswith(
        f"ddpgpt: unhealthy: step {STEPS}: the run trained to its end but is not healthy: its "
        "loss never came back near where it was before the spike at step 6: the median of its "
        "last 3 steps is ")
    assert "ddpgpt: next: " not in result.stderr
    rollbacks = events(run_dir, "rollback")
    assert [(e["checkpoint_step"], e["lr_factor"], e["skipped_batches"]) for e in rollbacks] == \
        [(3, 0.5, 5), (3, 0.25, 10)]
    (given_up,) = events(run_dir, "give_up")
    assert (given_up["step"], given_up["first_step"]) == (8, 6)
    assert warnings(result)[-1].endswith(
        "2 rollbacks within 100 steps have not helped (run.max_rollbacks = 2): training on "
        "through it")
    assert (run_dir / "checkpoints" / f"step_{STEPS:07d}").is_dir()  # written, said unhealthy
    rows = read_metrics(run_dir)[0]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert rows[-1]["lr"] == pytest.approx(
        lr_at(STEPS - 1, OptimConfig(lr=1e-2, warmup_steps=2), STEPS) * 0.25, rel=1e-12)


def test_tensorboard_shows_each_step_once_after_a_rollback_to_the_initial_state(
        tiny_data, tmp_path):
    """No checkpoint before the end: weights broken from step 4 roll back to the initial state;
    TensorBoard's event files, as metrics.jsonl, then hold steps 1-10 once each."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = tmp_path / "run"
    (result,) = spike_run(tiny_data, run_dir, 1, "weights@3", run__checkpoint_every=0,
                          run__tracker="tensorboard")
    # 10 steps: a rollback to the start loses little, so the start says nothing of it (a run
    # longer than the default checkpoint period does: tests/e2e/test_output.py)
    assert "can only roll back to the start" not in result.stderr
    # the median the spike was judged by: the window's 3 steps, not the rebuilt guard's 0
    assert "of the last 3 steps (the spike began at step 4); rolling back to step 0 (the " \
        "initial state)" in result.stderr
    (rollback,) = events(run_dir, "rollback")
    assert (rollback["step"], rollback["checkpoint"], rollback["spike_step"]) == (0, None, 6)
    rows = read_metrics(run_dir)[0]
    tb = EventAccumulator(str(run_dir / "tensorboard"))
    tb.Reload()
    got = [(e.step, e.value) for e in tb.Scalars("loss")]
    assert [s for s, _ in got] == [r["step"] for r in rows] == list(range(1, STEPS + 1))
    np.testing.assert_allclose([v for _, v in got], [r["loss"] for r in rows], rtol=1e-6)


def test_broken_weights_on_one_rank_alone_roll_back_as_on_every_rank(runs, tiny_data, tmp_path):
    """The fault on rank 0 only: its share of the probe is scaled before the probe's all-reduce,
    so both ranks see the same verdicts (scaling the reduced value on one rank made them
    disagree, and gloo abort on a size mismatch)."""
    run_dir = tmp_path / "run"
    spike_run(tiny_data, run_dir, 2, "weights@5@0")
    reference, _ = runs["weights", 1]
    assert [(e["event"], e.get("checkpoint_step"), e.get("skipped_batches"))
            for e in events(run_dir)] == [("rollback", 3, 5), ("recovered", None, None)]
    rows, ref = read_metrics(run_dir)[0], read_metrics(reference)[0]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    np.testing.assert_allclose([r["loss"] for r in rows[3:]], [r["loss"] for r in ref[3:]],
                               rtol=LOSS_TOL, atol=0)  # after the rollback: the same history


@pytest.mark.parametrize("fault, code, W", [("rolled:term@4", EXIT_PREEMPTED, 1),
                                            ("rolled:kill@3", -9, 1),
                                            ("rolled:kill@3", -9, 2)])
def test_a_restart_right_after_a_rollback_goes_on_with_the_rolled_back_history(
        runs, tiny_data, tmp_path, fault, code, W):
    """Stopped (SIGTERM after the rolled-back step 4) or killed (before the rolled-back step 4)
    right after "rolling back to step 3", while the abandoned history's checkpoint 6 was on the
    disk: the same command resumes from the rolled-back state, not from checkpoint 6: the
    rollback's data skip and its lr × 0.5, every step once. Bitwise as the uninterrupted run at
    the same W; at W=2 after a kill at W=1, within the float tolerance of another W."""
    run_dir = tmp_path / "run"
    stopped = spike_run(tiny_data, run_dir, 1, f"weights@5,{fault}", check=False)
    assert codes(stopped)[0] == [code], codes(stopped)[1]
    kept = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert kept == (["step_0000003", "step_0000005"] if code == EXIT_PREEMPTED
                    else ["rollback.json", "step_0000003"])
    (aside,) = run_dir.glob("rollback-*")  # the abandoned history, set aside, not deleted
    assert sorted(p.name for p in (aside / "checkpoints").iterdir()) == ["step_0000006"]
    (again,) = spike_run(tiny_data, run_dir, W, "") if W == 1 else \
        (spike_run(tiny_data, run_dir, W, "")[0],)
    if code != EXIT_PREEMPTED:
        assert "ddpgpt: going on with the rollback after step 8 to step 3: skipping the 5 " \
            "global batches read after it, the lr × 0.5 from now on" in again.stderr
    reference, _ = runs["weights", 1]
    rows, ref = read_metrics(run_dir)[0], read_metrics(reference)[0]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert [r["lr"] for r in rows] == [r["lr"] for r in ref]
    if W == 1:
        assert [r["loss"] for r in rows] == [r["loss"] for r in ref]
        final = f"checkpoints/step_{STEPS:07d}"
        weights, ref_weights = saved_weights(run_dir / final), saved_weights(reference / final)
        assert all(torch.equal(weights[k], ref_weights[k]) for k in ref_weights)
    else:
        np.testing.assert_allclose([r["loss"] for r in rows], [r["loss"] for r in ref],
                                   rtol=LOSS_TOL, atol=0)
    assert not (run_dir / "checkpoints" / "rollback.json").exists()  # spent by checkpoint 6

"""What "recovered" means and the run's verdict at its end (guard/spike.py, Guard.end), one
process: a spike is over once the loss is back near the median before it (1.1 ×, never above
ln V), at or after the step it began, whether trained through or rolled back; a run ends
unhealthy when that never happened, when its loss or val loss ends above ln V after being
below it, or when either rose above spike_ratio × the lowest it had been."""

import math

import pytest

from ddpgpt.checkpoint import store
from ddpgpt.config.schema import RunConfig
from ddpgpt.distributed.group import DistEnv
from ddpgpt.guard.health import Guard, Health, StopSignal
from ddpgpt.guard.spike import SpikePolicy

V = 257  # byte data: ln V = 5.549


def guard(tmp_path=None, losses=(4.0, 4.0), **run) -> Guard:
    """A guard on byte data whose window (2 steps) holds `losses`."""
    g = Guard(DistEnv(), RunConfig(spike_window=2, **run), StopSignal(announce=False),
              checkpoints=tmp_path, vocab=V)
    for step, loss in enumerate(losses, 1):
        assert step_to(g, step, loss).action == "update"
    return g


def step_to(g: Guard, step: int, loss: float, probe: float = 20.0):
    return g.judge(step, Health(loss, [], False), step - 1, lambda batch: probe)


def test_a_healthy_run_ends_with_nothing_to_say():
    g = guard(losses=(5.5, 5.0, 4.6, 4.2, 4.4, 4.1))
    g.spikes.evaluated(4.9)
    g.spikes.evaluated(4.3)
    assert g.end(6) is None


def test_a_spike_not_back_near_its_level_when_the_run_ends_is_unhealthy(tmp_path):
    """Trained through, then no rollback left (run.max_rollbacks = 0): the run trains on at
    1.4 × the level before the spike, under the spike ratio, and ends. Recovered would have
    been 4.4 or less."""
    c1, c2 = (store.step_dir(tmp_path, s) for s in (1, 3))
    for c in (c1, c2):
        c.mkdir()
    g = guard(tmp_path, spike_patience=2, max_rollbacks=0)
    g.spikes.evaluated(4.5)
    assert step_to(g, 3, 9.0).event == "spike"
    assert [step_to(g, s, 5.6).event for s in (4, 5, 6, 7)] == [None, "give_up", None, None]
    g.spikes.evaluated(5.2)
    ended = g.end(7)
    assert (ended.event, ended.fields) == ("unhealthy", {
        "loss_median": 5.6, "steps": 2, "last_val_loss": 5.2, "why": "not recovered",
        "spike_step": 3, "median": 4.0, "bound": pytest.approx(4.4), "val_before": 4.5})
    assert ended.line == (
        "step 7: the run trained to its end but is not healthy: its loss never came back near "
        "where it was before the spike at step 3: the median of its last 2 steps is 5.6, above "
        "4.4 (1.1 × the median 4 before it); val_loss 5.2 against 4.5 before it. Its checkpoints "
        f"are not a trained model. The newest healthy checkpoint is {c1}: to resume from it, "
        f"run the same command with --resume {c1}, and lower optim.lr")


def test_after_a_rollback_recovered_is_back_near_the_level_at_or_after_the_spike_step():
    """The trouble travels with the rollback (rollback.apply_rollback): the rolled-back run's
    first steps are its checkpoint's healthy ones, and count only from the step the spike
    began; a run that never gets back there ends unhealthy."""
    g = guard(spike_patience=2)
    assert step_to(g, 3, 9.0).event == "spike"
    step_to(g, 4, 9.0)
    assert step_to(g, 5, 9.0).action == "rollback"
    trouble = g.spikes.trouble
    assert trouble == {"step": 3, "median": 4.0, "val": "inf"}
    back = Guard(DistEnv(), RunConfig(spike_window=2, spike_patience=2),
                 StopSignal(announce=False), vocab=V)
    back.load_state_dict(g.state_dict())  # as from the checkpoint before; then the record's:
    back.spikes.through, back.spikes.trouble = 0, dict(trouble)
    back.spikes.rolled_back(5, 0, 5)
    assert step_to(back, 2, 4.0).event is None  # before step 3: the checkpoint's own steps
    assert step_to(back, 3, 4.8).event is None  # not back: under the ratio, joins the window
    recovered = step_to(back, 4, 4.3)
    assert (recovered.event, recovered.line) == ("recovered", (
        "step 4: recovered: the loss 4.3 is back near the median 4 before the spike at step 3 "
        "(at most 4.4), after 1 rollback"))
    assert back.spikes.trouble is None and back.end(4) is None


@pytest.mark.parametrize("median, bound", [(5.3, 5.549), (6.0, 6.6)])
def test_recovered_is_never_above_ln_v_once_the_run_was_below_it(median, bound):
    g = guard(losses=(median, median), spike_patience=5)
    step_to(g, 3, 20.0)
    assert g.spikes.bound() == pytest.approx(bound, abs=5e-4)


def test_a_spike_before_any_healthy_step_is_over_at_the_first_finite_loss():
    """A non-finite value before the window has a median: nothing to get back to but finite."""
    g = Guard(DistEnv(), RunConfig(spike_window=2), StopSignal(announce=False), vocab=V)
    verdict = g.judge(1, Health(math.nan, [0], False), 0, lambda batch: math.nan)
    assert verdict.action == "rollback" and g.spikes.bound() == math.inf
    assert step_to(g, 1, 5.6).event == "recovered" and g.end(1) is None


def test_a_run_that_ends_worse_than_uniform_is_unhealthy():
    """Below ln V (5.549), then drifting above it in steps under the spike ratio: no spike is
    ever found, the end says it."""
    g = guard(losses=(5.0, 5.0, 5.3, 5.6, 5.7))
    ended = g.end(5)
    assert ended.fields["why"] == "worse than uniform"
    assert "it ends worse than uniform: the median of its last 2 steps is 5.65, above ln V = " \
        "5.549, what a uniform guess over the vocabulary scores. " in ended.line
    g = guard(losses=(5.0, 5.0, 5.1))  # the val loss alone
    g.spikes.evaluated(5.2)
    g.spikes.evaluated(5.8)
    assert g.end(3).fields["why"] == "worse than uniform"


def test_a_loss_that_rose_far_above_its_lowest_is_unhealthy():
    g = guard(losses=(2.0, 2.0, 2.9, 3.5, 4.2, 4.6, 5.0))
    ended = g.end(7)
    assert (ended.fields["why"], ended.fields["best"], ended.fields["best_step"]) == ("rose", 2.0,
                                                                                    2)
    assert "its loss rose: the median of its last 2 steps is 4.8, above 2 × the lowest it had " \
        "been (the median 2 at step 2)" in ended.line
    g = guard(losses=(2.0, 2.0, 2.1))  # the val loss alone
    for val in (2.5, 2.2, 4.5):
        g.spikes.evaluated(val)
    assert g.end(3).fields["why"] == "rose"


def test_the_verdicts_state_round_trips():
    cfg = RunConfig(spike_window=2)
    policy = SpikePolicy(cfg, V)
    policy.healthy(1, 3.0, batch=0)
    policy.healthy(2, 2.5, batch=1)
    policy.seen(7.0)
    policy.evaluated(3.5)
    policy.trouble = {"step": 3, "median": 2.75, "val": 3.5}
    again = SpikePolicy(cfg, V)
    again.load_state_dict(policy.state_dict())
    assert again.state_dict() == policy.state_dict()
    assert (again.state_dict()["lately"], again.state_dict()["best"], again.val) == (
        [7.0], [2.75, 2], [3.5, 3.5])


@pytest.mark.parametrize("probe, cause", [(4.3, "data"), (4.5, "weights"), (7.9, "weights")])
def test_the_data_is_the_cause_only_if_the_weights_still_do_as_well_on_the_last_batch(probe,
                                                                                      cause):
    """That batch scored 4 when it was trained on: the weights must still give about that
    (at most 1.1 ×). Weights that give 1.9 × were taken for sound (under the spike ratio), their
    spikes skipped as bad data, and after run.spike_patience of them taken for a new domain
    that started the median over at the broken level: a ruined run never flagged."""
    verdict = step_to(guard(), 3, 9.0, probe=probe)
    assert verdict.fields["cause"] == cause

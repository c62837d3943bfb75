"""What "recovered" means and the run's verdict at its end (guard/verdict.py, Guard.end), one
process: a spike is over once the loss is back near the median before it (1.1 ×, never above
ln V), at or after the step it began, whether trained through or rolled back; a run ends
unhealthy when that never happened, when its loss or val loss ends above ln V after being
below it or diverged from its start, or when its loss rose above spike_ratio × the lowest it
had been or its val loss above 1.1 × its lowest. Other data (a shift, a resume on other data on
purpose) starts what it is compared with anew, and the end says which steps skipped their
update."""

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
    g.spikes.evaluated(3, 4.9)
    g.spikes.evaluated(6, 4.3)
    assert g.end(6) is None


def test_a_spike_not_back_near_its_level_when_the_run_ends_is_unhealthy(tmp_path):
    """Trained through, then no rollback left (run.max_rollbacks = 0): the run trains on at
    1.4 × the level before the spike, under the spike ratio, and ends. Recovered would have
    been 4.4 or less."""
    c1, c2 = (store.step_dir(tmp_path, s) for s in (1, 3))
    for c in (c1, c2):
        c.mkdir()
    g = guard(tmp_path, spike_patience=2, max_rollbacks=0)
    g.spikes.evaluated(2, 4.5)
    assert step_to(g, 3, 9.0).event == "spike"
    assert [step_to(g, s, 5.6).event for s in (4, 5, 6, 7)] == [None, "give_up", None, None]
    g.spikes.evaluated(7, 5.2)
    ended = g.end(7)
    assert (ended.event, ended.fields) == ("unhealthy", {
        "loss_median": 5.6, "steps": 2, "last_val_loss": 5.2, "why": "not recovered",
        "spike_step": 3, "median": 4.0, "bound": pytest.approx(4.4), "val_before": 4.5,
        "skipped_steps": 0})
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
    g.spikes.evaluated(2, 5.2)
    g.spikes.evaluated(3, 5.8)
    assert g.end(3).fields["why"] == "worse than uniform"


def test_a_loss_that_rose_far_above_its_lowest_is_unhealthy():
    g = guard(losses=(2.0, 2.0, 2.9, 3.5, 4.2, 4.6, 5.0))
    ended = g.end(7)
    assert (ended.fields["why"], ended.fields["best"], ended.fields["best_step"]) == ("rose", 2.0,
                                                                                    2)
    assert "its loss rose: the median of its last 2 steps is 4.8, above 2 × the lowest it had " \
        "been (the median 2 at step 2)" in ended.line
    g = guard(losses=(2.0, 2.0, 2.1))  # the val loss alone
    for step, val in enumerate((2.5, 2.2, 4.5), 1):
        g.spikes.evaluated(step, val)
    assert g.end(3).fields["why"] == "rose"


def test_the_verdicts_state_round_trips():
    cfg = RunConfig(spike_window=2)
    policy = SpikePolicy(cfg, V)
    policy.healthy(1, 3.0, batch=0)
    policy.healthy(2, 2.5, batch=1)
    policy.seen(3, 7.0)
    policy.evaluated(3, 3.5)
    policy.trouble = {"step": 3, "median": 2.75, "val": 3.5}
    policy.data_skips = 2
    again = SpikePolicy(cfg, V)
    again.load_state_dict(policy.state_dict())
    assert again.state_dict() == policy.state_dict()
    assert (again.state_dict()["lately"], again.state_dict()["best"], again.val, again.first,
            again.data_skips) == ([7.0], [2.75, 2], [3.5, 3.5, 3], [7.0, 3], 2)
    # saved before the first loss, the skips and the lowest val loss's step were kept
    again.load_state_dict({k: v for k, v in policy.state_dict().items()
                           if k not in ("first", "data_skips")} | {"val": [3.5, 3.5]})
    assert (again.val, again.first, again.data_skips) == ([3.5, 3.5, 0], [math.inf, 0], 0)


@pytest.mark.parametrize("probe, cause", [(4.3, "data"), (4.5, "weights"), (7.9, "weights")])
def test_the_data_is_the_cause_only_if_the_weights_still_do_as_well_on_the_last_batch(probe,
                                                                                      cause):
    """That batch scored 4 when it was trained on: the weights must still give about that
    (at most 1.1 ×). Weights that give 1.9 × were taken for sound (under the spike ratio), their
    spikes skipped as bad data, and after run.spike_patience of them taken for a new domain
    that started the median over at the broken level: a ruined run never flagged."""
    verdict = step_to(guard(), 3, 9.0, probe=probe)
    assert verdict.fields["cause"] == cause


# ---- a run that never learned, a slow drift ------------------------------------------------------

# Measured: the tiny model on byte data at --optim.lr 3 --optim.warmup-steps 0 (20 steps, an
# evaluation every 5). Its first update blows it up; the spike window fills with the diverged
# losses, so no spike is ever found, and it never was below ln V, nor rose past 2 × its lowest.
DIVERGED = (5.547, 110.6, 166.3, 147.3, 101.5, 105.2, 101.1, 84.43, 59.97, 58.81, 42.73, 41.78,
            39.02, 41.88, 38.71, 30.19, 23.82, 16.23, 15.3, 20.98)


def judged(losses, vals: dict, tmp_path=None, **run) -> Guard:
    """A guard on byte data that saw `losses` from step 1 on and `vals` ({step: val_loss})."""
    g = Guard(DistEnv(), RunConfig(**{"spike_window": 5, **run}), StopSignal(announce=False),
              checkpoints=tmp_path, vocab=V)
    for step, loss in enumerate(losses, 1):
        assert step_to(g, step, loss).action == "update"
        if step in vals:
            g.spikes.evaluated(step, vals[step])
    return g


def test_a_run_that_diverges_from_its_first_update_ends_unhealthy(tmp_path):
    for s in (5, 10, 15, 20):
        store.step_dir(tmp_path, s).mkdir()
    g = judged(DIVERGED, {5: 103.9, 10: 46.52, 15: 31.16, 20: 17.91}, tmp_path)
    ended = g.end(20)
    assert (ended.fields["why"], ended.fields["first_loss"], ended.fields["first_step"]) == (
        "worse than uniform", 5.547, 1)
    assert ended.line == (
        "step 20: the run trained to its end but is not healthy: it ends worse than uniform: the "
        "median of its last 5 steps is 20.98; val_loss 17.91, above ln V = 5.549, what a uniform "
        "guess over the vocabulary scores, and above 1.1 × the loss 5.547 it started from at "
        "step 1: it diverged from its start. Its checkpoints are not a trained model. No "
        "checkpoint before it is known healthy: --reset starts over, and lower optim.lr")


@pytest.mark.parametrize("losses, val", [
    ((5.5475, 5.5596, 5.5607), 5.5362),  # measured: lr 1e-6, 3 steps
    ((5.5533, 5.5602, 5.5611), 5.5581),  # its first step's loss already above ln V
])
def test_a_run_that_barely_moved_from_its_untrained_start_is_not_called_diverged(losses, val):
    """Untrained weights score about ln V, a little above or below it, batch to batch: a short
    run at a tiny lr ends there, which is not worse than where it started."""
    assert judged(losses, {len(losses): val}).end(len(losses)) is None


def test_a_slow_drift_of_the_val_loss_without_a_spike_is_unhealthy(tmp_path):
    """An lr too high for late training: the loss creeps up 2% a step, never a spike (each step
    under 2 × the window's median), the median never past 2 × its lowest; on the same val text
    the weights got 30% worse than at step 10. The checkpoint of step 10 is the one to keep."""
    for s in (10, 20, 30):
        store.step_dir(tmp_path, s).mkdir()
    losses = [3.3, 3.2, 3.1, 3.05, 3.0, 3.0, 3.0, 3.0, 3.0, 3.0]
    losses += [round(3.0 * 1.02 ** k, 4) for k in range(1, 21)]
    g = judged(losses, {10: 3.1, 20: 3.4, 30: 4.04}, tmp_path)
    ended = g.end(30)
    assert (ended.fields["why"], ended.fields["best_val_loss"], ended.fields["best_val_step"]) == (
        "rose", 3.1, 10)
    assert ended.line == (
        "step 30: the run trained to its end but is not healthy: its val loss rose: 4.04 at the "
        "end, above 1.1 × its lowest 3.1 (step 10) on the same val text: the weights got worse "
        "(the median of its last 5 steps is 4.285). Its checkpoints are not a trained model. "
        f"The newest healthy checkpoint is {store.step_dir(tmp_path, 10)}: to resume from it, "
        f"run the same command with --resume {store.step_dir(tmp_path, 10)}, and lower optim.lr")
    assert judged(losses[:10], {5: 3.3, 10: 3.1}).end(10) is None  # 3.3 then 3.1: no rise


# ---- other data: the baselines start anew -------------------------------------------------------

def test_a_shift_starts_what_the_end_compares_with_anew():
    """Unshuffled data reaching a harder domain: 3 batches spike as bad data, the fourth is a
    shift, trained on. The run then learns the new data (5.0 -> 4.4, below ln V), its val loss
    on the new data's level: not a rise from the old data's 2.2, and no trouble before it left
    to get back to."""
    g = judged((2.0,) * 5, {5: 2.2}, spike_patience=3)
    g.spikes.trouble = {"step": 2, "median": 2.0, "val": 2.2}  # a rollback's, not yet back
    assert [step_to(g, s, 5.0, probe=2.0).action for s in (6, 7, 8)] == ["skip"] * 3
    assert step_to(g, 9, 5.0, probe=2.0).event == "shift"
    spikes = g.spikes
    assert (list(spikes.losses), list(spikes.lately), spikes.first, spikes.trouble,
            spikes.probe_batch) == ([5.0], [5.0], [5.0, 9], None, -1)
    for step, loss in enumerate((4.9, 4.8, 4.6, 4.5, 4.4), 10):
        assert step_to(g, step, loss).action == "update"
    g.spikes.evaluated(14, 4.5)
    assert g.end(14) is None


def test_other_data_starts_the_spike_window_and_the_ends_baselines_anew():
    """A resume on other data (data.allow_switch, or other mixture weights): nothing measured
    on the old data is compared with the new, so its higher losses are neither spikes (none is
    looked for until the window is full of them) nor a rise at the end. What the weights went
    through stays: the rollbacks, the lr factor, the checkpoints known healthy."""
    g = judged((1.0,) * 5, {5: 0.9})
    spikes = g.spikes
    spikes.rolled_back(4, 0, 2)
    spikes.confirm(3)
    spikes.trouble = {"step": 4, "median": 1.0, "val": 0.9}
    spikes.anew()
    assert (list(spikes.losses), list(spikes.lately), spikes.best, spikes.val[:2], spikes.first,
            spikes.trouble, spikes.probe_batch) == ([], [], [math.inf, 0], [math.inf] * 2,
                                                     [math.inf, 0], None, -1)
    assert (spikes.lr_factor, len(spikes.rollbacks), spikes.healthy_checkpoints) == (0.5, 1, [3])
    for step, loss in enumerate((4.0, 4.1, 3.9, 3.9, 3.8, 3.8, 3.7), 6):
        assert step_to(g, step, loss).event is None
    g.spikes.evaluated(12, 3.9)
    assert g.end(12) is None


# ---- the end says how many steps skipped their update ----------------------------------------

def test_the_end_says_how_many_steps_skipped_their_update(tmp_path):
    g = guard(tmp_path, on_nonfinite="spike", spike_patience=5)
    assert [step_to(g, s, 9.0, probe=4.0).action for s in (3, 4)] == ["skip", "skip"]
    assert step_to(g, 5, 4.1).action == "update"
    assert g.skipped_steps(5) == "2 of the run's 5 steps skipped their update (2 whose batch " \
        "spiked: the data)"
    g.skipped = 1  # a non-finite step skipped (run.on_nonfinite skip)
    assert g.skipped_steps(5) == "3 of the run's 5 steps skipped their update (2 whose batch " \
        "spiked: the data; 1 non-finite)"
    assert guard().skipped_steps(2) == ""
    for step in (6, 7):
        step_to(g, step, 5.8)  # above ln V, having been below it
    ended = g.end(7)
    assert ended.fields["skipped_steps"] == 3
    assert "3 of the run's 7 steps skipped their update (2 whose batch spiked: the data; 1 " \
        "non-finite). Its checkpoints are not a trained model." in ended.line

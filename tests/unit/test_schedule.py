"""The learning-rate schedules (cosine, wsd, constant) against their closed forms, on a grid of
warmups, lengths and steps; a wsd run extended on resume; the rollback factor; the floor
(optim.min_lr: a tenth of lr unset); a schedule started later in a run (optim.schedule_start);
a warmup longer than its schedule."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

from ddpgpt.config.optim import OptimConfig
from ddpgpt.config.schema import RunConfig, TrainConfig
from ddpgpt.errors import UserError
from ddpgpt.optim.schedule import Rates, Schedule, lr_at, momentum_at
from ddpgpt.run.resume import Start, settle

# ---- the learning-rate schedule --------------------------------------------------------------

CFG = OptimConfig(lr=1e-3, min_lr=1e-4, warmup_steps=10)
TOTAL = 111  # decay over steps 10..110: a span of 100, midpoint at step 60


def test_warmup_is_linear():
    assert lr_at(0, CFG, TOTAL) == pytest.approx(1e-4, rel=1e-12)  # lr / warmup
    assert lr_at(9, CFG, TOTAL) == 1e-3
    for step in range(10):
        assert lr_at(step, CFG, TOTAL) == pytest.approx(1e-3 * (step + 1) / 10, rel=1e-12)


def test_cosine_decay():
    assert lr_at(10, CFG, TOTAL) == 1e-3
    assert lr_at(60, CFG, TOTAL) == pytest.approx((1e-3 + 1e-4) / 2, rel=1e-12)
    assert lr_at(TOTAL - 1, CFG, TOTAL) == 1e-4  # exactly min_lr at the last step
    for step in range(10, TOTAL):
        closed_form = 1e-4 + 0.5 * (1e-3 - 1e-4) * (1 + math.cos(math.pi * (step - 10) / 100))
        assert lr_at(step, CFG, TOTAL) == pytest.approx(closed_form, rel=1e-12)
    assert lr_at(TOTAL + 50, CFG, TOTAL) == 1e-4  # past the end: stays at min_lr


def test_monotone_after_warmup():
    lrs = [lr_at(step, CFG, TOTAL) for step in range(TOTAL)]
    assert all(a < b for a, b in zip(lrs[:10], lrs[1:10]))
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:]))


def test_no_warmup_starts_at_lr():
    cfg = OptimConfig(lr=2e-3, min_lr=0.0, warmup_steps=0)
    assert lr_at(0, cfg, 50) == 2e-3
    assert lr_at(49, cfg, 50) == 0.0


def test_lr_at_is_a_pure_function():
    first = [lr_at(step, CFG, TOTAL) for step in range(TOTAL)]
    backwards = [lr_at(step, CFG, TOTAL) for step in reversed(range(TOTAL))][::-1]
    assert first == backwards == [lr_at(step, CFG, TOTAL) for step in range(TOTAL)]


# ---- every (warmup, length, step): the shape on a grid ----------------------------------------

SCHEDULES = ("cosine", "wsd", "constant")


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_the_schedule_has_one_shape_for_every_warmup_length_and_step(schedule):
    """Every warmup 0..12, decay_steps 0..12 (0: run.steps) and run.steps 1..12, every step up
    to well past the end: the warmup is linear until the schedule ends or the warmup does; cosine
    and wsd are at min_lr from the schedule's length on, and at its last step when the warmup
    ended before it; nothing is above the peak; and once the lr has fallen it never rises again
    (so no step after the peak returns to it)."""
    peak, floor = 1.0, 0.125
    for warmup in range(13):
        for decay in range(13):
            for steps in range(1, 13):
                cfg = OptimConfig(lr=peak, min_lr=floor, warmup_steps=warmup, decay_steps=decay,
                                  schedule=schedule, decay_fraction=0.3)
                length = decay or steps
                lrs = [lr_at(s, cfg, steps) for s in range(3 * 13)]
                where = f"{schedule}, warmup {warmup}, length {length}: {lrs}"
                ends = schedule != "constant"
                for s, lr in enumerate(lrs):
                    assert 0 < lr <= peak, where
                    if s < warmup and not (ends and s >= length):
                        assert lr == pytest.approx(peak * (s + 1) / warmup, rel=1e-12), where
                    elif ends and s >= length:
                        assert lr == floor, where
                    elif schedule == "constant":
                        assert lr == peak, where
                    else:
                        assert floor <= lr, where
                if ends and warmup < length:
                    assert lrs[length - 1] == floor, where
                fell = [s for s in range(1, len(lrs)) if lrs[s] < lrs[s - 1]]
                assert all(lrs[s] <= lrs[s - 1] for s in range(fell[0] if fell else len(lrs),
                                                                len(lrs))), where
                at_peak = [s for s, lr in enumerate(lrs) if lr == peak]
                assert at_peak == list(range(at_peak[0], at_peak[-1] + 1)) if at_peak else True
                if schedule == "cosine":  # the warmup's last step and the cosine's first
                    assert len(at_peak) <= 2, where


def test_a_schedule_no_longer_than_its_warmup_gives_no_step_at_the_peak_after_its_end():
    """warmup 20, decay 20: step 19 ends the warmup at the peak, the schedule ends there; steps
    20 on (a run resumed with more steps) are at min_lr, not one more at the peak. A run of 10
    steps with the default warmup of 20, resumed to 30: the lr never rises past the 0.5 of its
    last step."""
    cfg = OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=20, decay_steps=20)
    assert [lr_at(s, cfg, 20) for s in range(18, 23)] == pytest.approx([0.95, 1.0, 0.1, 0.1,
                                                                        0.1], rel=1e-12)
    for schedule in ("cosine", "wsd"):
        short = OptimConfig(lr=1.0, min_lr=0.1, schedule=schedule)
        resumed = _resumed(short, saved_steps=10, at=10, steps=30)
        lrs = [lr_at(s, resumed, 30) for s in range(30)]
        assert lrs[:10] == pytest.approx([(s + 1) / 20 for s in range(10)], rel=1e-12)
        assert max(lrs[10:]) <= 1.0
        if schedule == "cosine":
            assert lrs[10:] == [0.1] * 20


# ---- wsd and constant, and a wsd run extended on resume ---------------------------------------

WSD = OptimConfig(lr=1e-3, min_lr=1e-4, warmup_steps=10, schedule="wsd", decay_fraction=0.2)


def test_wsd_is_flat_then_linear_to_min_lr_over_the_last_fraction():
    lrs = [lr_at(step, WSD, 100) for step in range(100)]
    assert lrs[:10] == [lr_at(step, CFG, TOTAL) for step in range(10)]  # cosine's warmup
    assert lrs[10:80] == [1e-3] * 70  # flat up to the decay's first step, 100 - 20 = 80
    for step in range(80, 100):  # linear over the last 20 steps, down to min_lr at the last
        assert lrs[step] == pytest.approx(1e-3 - 9e-4 * (step - 79) / 20, rel=1e-12)
    assert lrs[99] == 1e-4 and lr_at(150, WSD, 100) == 1e-4


def test_constant_is_flat_after_warmup():
    cfg = OptimConfig(lr=1e-3, min_lr=1e-4, warmup_steps=10, schedule="constant")
    assert [lr_at(s, cfg, 100) for s in range(10, 300)] == [1e-3] * 290


def _resumed(cfg: OptimConfig, saved_steps: int, at: int, steps: int) -> OptimConfig:
    """The optim config a run started with run.steps = saved_steps, checkpointed at step `at`
    and resumed with run.steps = steps trains with (resume.settle on the checkpoint's meta)."""
    first = settle(TrainConfig(optim=cfg, run=RunConfig(steps=saved_steps)), Start())
    meta = {"step": at, "config": first.to_dict()}
    return settle(TrainConfig(optim=cfg, run=RunConfig(steps=steps)),
                  Start(Path("ckpt"), meta)).optim


def test_wsd_resumed_in_its_flat_phase_with_more_steps_stays_flat_and_decays_at_the_new_end():
    resumed = _resumed(WSD, saved_steps=100, at=50, steps=300)
    before = [lr_at(s, settle(TrainConfig(optim=WSD, run=RunConfig(steps=100)), Start()).optim,
                    100) for s in range(50)]
    after = [lr_at(s, resumed, 300) for s in range(50, 300)]
    assert before[10:] == [1e-3] * 40
    assert after[:190] == [1e-3] * 190  # no re-warming, no jump: flat to step 240 = 300 - 60
    assert after[190] < 1e-3 and after[-1] == 1e-4
    # Resumed inside its decay, or as a cosine, the schedule keeps its first length.
    assert _resumed(WSD, 100, 85, 300).decay_steps == 100
    assert _resumed(CFG, 100, 50, 300).decay_steps == 100
    # Fewer steps whose decay would begin before the resume point: kept as well (no jump).
    assert _resumed(WSD, 100, 50, 60).decay_steps == 100


def test_schedule_applies_the_rollback_factor_at_every_step():
    factor = [1.0]
    schedule = Schedule(WSD, 100, lambda: factor[0])
    assert schedule.at(40) == Rates(1e-3, momentum_at(40, WSD))
    assert schedule.at(150) == Rates(1e-4, 0.95)  # momentum warmed up by step 100
    factor[0] = 0.25
    assert schedule.at(40).lr == 0.25e-3 and schedule.at(0).momentum == WSD.muon_momentum_start


# ---- the floor -------------------------------------------------------------------------------

def test_min_lr_unset_is_a_tenth_of_lr_and_follows_it():
    """Unset, the decay ends at a tenth of optim.lr whatever lr is (a fine-tune at 1e-4 or 1e-5
    decays too; none is refused); set, at the floor as given, 0 included."""
    for lr in (1e-2, 1e-3, 1e-4, 1e-5):
        cfg = OptimConfig(lr=lr, warmup_steps=0)
        assert cfg.min_lr is None and cfg.floor == lr / 10
        assert [lr_at(s, cfg, 50) for s in (0, 49, 80)] == pytest.approx([lr, lr / 10, lr / 10],
                                                                         rel=1e-12)
    assert lr_at(49, OptimConfig(lr=1e-3, min_lr=0.0, warmup_steps=0), 50) == 0.0
    assert lr_at(49, OptimConfig(lr=1e-3, min_lr=3e-4, warmup_steps=0), 50) == 3e-4


# ---- a schedule of its own later in a run ----------------------------------------------------

@pytest.mark.parametrize("schedule", SCHEDULES)
def test_a_schedule_started_later_is_the_first_one_moved_there(schedule):
    """optim.schedule_start S with the schedule ending at E: step S + s has the lr that step s
    has on a schedule of E - S steps started at 0 (its warmup, its decay, min_lr after E); the
    steps before S (only a rollback past S trains them again) are at min_lr."""
    for start, end, warmup in ((200, 400, 20), (7, 12, 2), (5, 6, 0), (30, 40, 15)):
        later = OptimConfig(lr=2e-3, warmup_steps=warmup, decay_steps=end, schedule=schedule,
                            schedule_start=start)
        first = dataclasses.replace(later, decay_steps=end - start, schedule_start=0)
        assert [lr_at(start + s, later, end) for s in range(end - start + 5)] == \
            [lr_at(s, first, end - start) for s in range(end - start + 5)]
        assert [lr_at(s, later, end) for s in range(start)] == [later.floor] * start


def test_a_new_schedule_start_takes_the_new_run_steps_as_its_end():
    """A cosine of 200 steps resumed at its end with run.steps 400: kept (steps 201-400 at
    min_lr) unless optim.schedule_start is new; then it ends at the new run.steps, warms up again
    and decays. Stretching a wsd run in its flat phase works on the new schedule as on the
    first."""
    assert _resumed(CFG, saved_steps=200, at=200, steps=400).decay_steps == 200
    meta = {"step": 200, "config": settle(TrainConfig(optim=CFG, run=RunConfig(steps=200)),
                                          Start()).to_dict()}
    later = TrainConfig(optim=dataclasses.replace(CFG, schedule_start=200),
                        run=RunConfig(steps=400))
    anew = settle(later, Start(Path("ckpt"), meta)).optim
    assert (anew.decay_steps, anew.schedule_start) == (400, 200)
    lrs = [lr_at(s, anew, 400) for s in range(200, 400)]
    assert lrs[:10] == pytest.approx([1e-3 * (s + 1) / 10 for s in range(10)], rel=1e-12)
    assert lrs[10] == 1e-3 and lrs[-1] == 1e-4
    flat = dataclasses.replace(WSD, schedule_start=100, decay_steps=300)
    meta = {"step": 150, "config": TrainConfig(optim=flat, run=RunConfig(steps=300)).to_dict()}
    stretched = settle(TrainConfig(optim=dataclasses.replace(flat, decay_steps=0),
                                   run=RunConfig(steps=500)), Start(Path("ckpt"), meta)).optim
    assert stretched.decay_steps == 500 and lr_at(400, stretched, 500) == 1e-3


def test_a_schedule_start_past_where_the_run_starts_is_refused():
    """Past the step the run resumes at (or 0, from scratch), or with the schedule's end at or
    before it: one line with the fix. A restart (elastic) goes on as planned."""
    meta = {"step": 150, "config": TrainConfig(optim=CFG, run=RunConfig(steps=200)).to_dict()}
    later = TrainConfig(optim=dataclasses.replace(CFG, schedule_start=200),
                        run=RunConfig(steps=400))
    with pytest.raises(UserError) as e:
        settle(later, Start(Path("runs/r/checkpoints/step_0000150"), meta))
    assert str(e.value) == (
        "optim.schedule_start = 200 is past step 150, where this run starts (checkpoint "
        "step_0000150): a schedule starts at or before it; give --optim.schedule-start 150")
    with pytest.raises(UserError, match=r"past step 0, where this run starts \(from scratch\)"):
        settle(later, Start())
    assert settle(later, Start(Path("c"), meta), first_start=False).optim.decay_steps == 400
    ended = dataclasses.replace(later, optim=dataclasses.replace(later.optim, decay_steps=150))
    with pytest.raises(UserError) as e:
        settle(ended, Start(Path("c"), {**meta, "step": 200}))
    assert str(e.value) == (
        "optim.decay_steps = 150 ends the schedule at or before optim.schedule_start = 200, "
        "where it starts; give --optim.decay-steps N with N > 200, or 0 (run.steps)")


# ---- a warmup longer than its schedule ---------------------------------------------------------

def test_a_warmup_as_long_as_its_schedule_is_said_in_one_line():
    """tiny's 20 warmup steps on a run of 10: the lr only rises, to half the peak, and never
    decays; one line says so, with a warmup that fits. A warmup shorter than the schedule (a new
    schedule's included) is nothing to say."""
    from ddpgpt.optim.schedule import warmup_notes

    tiny = OptimConfig(lr=2e-3, warmup_steps=20, decay_steps=10)
    assert warmup_notes(tiny, 10) == [
        "optim.warmup_steps = 20 is not shorter than the schedule (10 steps, to step 10): the lr "
        "only rises, to 0.001 at step 10 of a peak of 0.002 (optim.lr), and never decays; give "
        "--optim.warmup-steps 1 or so (a tenth of the schedule) for a warmup and a decay"]
    assert warmup_notes(dataclasses.replace(tiny, schedule="constant"), 10) == [
        "optim.warmup_steps = 20 is not shorter than the schedule (10 steps, to step 10): the lr "
        "only rises, to 0.001 at step 10 of a peak of 0.002 (optim.lr); give "
        "--optim.warmup-steps 1 or so (a tenth of the schedule) for steps at the peak"]
    assert warmup_notes(dataclasses.replace(tiny, decay_steps=21), 21) == []
    anew = dataclasses.replace(tiny, decay_steps=210, schedule_start=200)
    assert warmup_notes(anew, 210)[0].startswith(
        "optim.warmup_steps = 20 is not shorter than the schedule (10 steps, to step 210)")
    assert warmup_notes(dataclasses.replace(anew, decay_steps=400), 400) == []

"""What a resume's changed settings do to the learning rate: the line that announces them says
the lr the next step takes, and how to get another where the schedule has ended."""

from __future__ import annotations

import dataclasses

from ddpgpt.config.optim import OptimConfig
from ddpgpt.config.schema import RunConfig, TrainConfig


def _settled(steps: int, decay: int, **optim) -> TrainConfig:
    return TrainConfig(optim=OptimConfig(lr=0.3, min_lr=1e-4, warmup_steps=2, decay_steps=decay,
                                         **optim), run=RunConfig(steps=steps))


def test_the_changed_settings_line_says_the_lr_they_give():
    """A schedule that has ended keeps every later step at optim.min_lr whatever optim.lr says:
    the line says so and how to schedule anew, with the lr that would give; a schedule still
    running: the next step's lr; nothing that decides the lr changed: nothing."""
    from ddpgpt.optim.schedule import lr_at
    from ddpgpt.run.resume import lr_note

    ended = _settled(60, 40)
    anew = lr_at(40, dataclasses.replace(ended.optim, decay_steps=60), 60)
    assert 1e-4 < anew < 0.3
    for changed in ({"optim.lr": [0.3, 30]}, {"run.steps": [40, 60]}):
        assert lr_note(ended, 40, 1.0, changed) == (
            f"; from step 41: lr 0.0001 (optim.min_lr: the schedule ended at step 40, "
            f"optim.decay_steps; --optim.decay-steps 60 schedules anew: lr {anew:.3g} at step "
            "41, optim.min_lr at step 60)")
    # after a rollback (lr × 0.5), with Muon's lr beside
    muon = _settled(60, 40, name="muon", muon_lr=0.02)
    assert lr_note(muon, 40, 0.5, {"run.steps": [40, 60]}).startswith(
        "; from step 41: lr 5e-05, muon_lr 3.33e-06 (optim.min_lr: ")
    running = _settled(60, 60)
    assert lr_note(running, 10, 1.0, {"optim.lr": [0.1, 0.3]}) == (
        f"; from step 11: lr {lr_at(10, running.optim, 60):.3g}")
    assert lr_note(_settled(60, 40, schedule="constant"), 40, 1.0, {"run.steps": [40, 60]}) == (
        "; from step 41: lr 0.3")
    assert lr_note(ended, 40, 1.0, {"run.log_every": [1, 10]}) == ""

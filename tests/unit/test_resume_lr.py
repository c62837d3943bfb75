"""What a resume's changed settings do to the learning rate: the line that announces them says
the lr the next step takes, and how to get another where the schedule has ended; a schedule's
length given on the command line reaches the `--nproc` workers; a floor that follows the lr."""

from __future__ import annotations

import dataclasses

import pytest

from ddpgpt.config.optim import OptimConfig
from ddpgpt.config.schema import DataConfig, RunConfig, TrainConfig
from ddpgpt.optim.schedule import lr_at
from ddpgpt.run import resume
from ddpgpt.run.changes import changes, lr_note
from ddpgpt.run.run_dir import RunDir


def _settled(steps: int, decay: int, **optim) -> TrainConfig:
    return TrainConfig(optim=OptimConfig(lr=0.3, min_lr=1e-4, warmup_steps=2, decay_steps=decay,
                                         **optim), run=RunConfig(steps=steps))


def test_the_changed_settings_line_says_the_lr_they_give():
    """A schedule that has ended keeps every later step at optim.min_lr whatever optim.lr says:
    the line says so, and how to train the new steps on a schedule of their own, with the lr
    that gives; a schedule started at this step: its course; a schedule still running: the next
    step's lr; nothing that decides the lr changed: nothing."""
    ended = _settled(60, 40)
    for changed in ({"optim.lr": [0.3, 30]}, {"run.steps": [40, 60]}):
        assert lr_note(ended, 40, 1.0, changed) == (
            "; from step 41: lr 0.0001, optim.min_lr, to step 60: the schedule ended at step 40; "
            "--optim.schedule-start 40 trains steps 41-60 on a cosine of their own: lr 0.15 at "
            "step 41, 0.3 at step 42 after its warmup, 0.0001 at step 60")
    # the advice followed: the line of that start says what it said
    anew = _settled(60, 60, schedule_start=40)
    assert lr_note(anew, 40, 1.0, {"optim.schedule_start": [0, 40]}) == (
        "; from step 41: lr 0.15, on a cosine of its own: 0.3 at step 42 after its warmup, "
        "0.0001 at step 60")
    assert [lr_at(s, anew.optim, 60) for s in (40, 41, 59)] == [0.15, 0.3, 1e-4]
    # after a rollback (lr × 0.5), with Muon's lr beside
    muon = _settled(60, 40, name="muon", muon_lr=0.02)
    assert lr_note(muon, 40, 0.5, {"run.steps": [40, 60]}).startswith(
        "; from step 41: lr 5e-05, muon_lr 3.33e-06, optim.min_lr, to step 60: ")
    running = _settled(60, 60)
    assert lr_note(running, 10, 1.0, {"optim.lr": [0.1, 0.3]}) == (
        f"; from step 11: lr {lr_at(10, running.optim, 60):.3g}")
    assert lr_note(_settled(60, 40, schedule="constant"), 40, 1.0, {"run.steps": [40, 60]}) == (
        "; from step 41: lr 0.3")
    assert lr_note(ended, 40, 1.0, {"run.log_every": [1, 10]}) == ""


def test_a_floor_that_follows_the_lr_is_listed_as_the_lr_it_is():
    """optim.min_lr unset is a tenth of optim.lr: a new lr moves it, and the line says both; an
    older checkpoint's number equal to it (its preset's, written out) is no change."""
    saved = _settled(60, 60).to_dict()
    unset = dataclasses.replace(_settled(60, 60), optim=OptimConfig(lr=0.3, warmup_steps=2,
                                                                    decay_steps=60))
    assert changes({**saved, "optim": {**saved["optim"], "min_lr": 0.03}}, unset) == {}
    lower = dataclasses.replace(unset, optim=dataclasses.replace(unset.optim, lr=0.1))
    assert changes(unset.to_dict(), lower) == {"optim.lr": [0.3, 0.1],
                                              "optim.min_lr": [pytest.approx(0.03), 0.01]}
    assert changes(saved, unset) == {"optim.min_lr": [1e-4, pytest.approx(0.03)]}


def test_the_workers_train_on_the_schedule_their_launcher_settled(tmp_path):
    """`train --run-dir R --run.steps 164 --optim.decay-steps 164` under --nproc, on a run whose
    cosine ended at 80: the launcher settles the length given and writes config.json; its
    workers, started from that file and the flags it hands them, train with the very same
    config (not the checkpoint's length: a decay_steps equal to run.steps is otherwise taken
    for the `auto` it may have come from)."""
    from ddpgpt import cli
    from ddpgpt.checkpoint import store
    from ddpgpt.model.gpt import GPT
    from ddpgpt.run.launch import worker_flags
    from tests.helpers import SMALL

    def parsed(*argv: str) -> TrainConfig:
        parser = cli._build_parser()
        ns = parser.parse_args(cli.bool_values(parser, ["train", *argv]))
        return cli.train_config({k: v for k, v in vars(ns).items()
                                 if k not in ("command", "debug")})[0]

    run = RunDir(tmp_path / "run")
    made = TrainConfig(model=SMALL, data=DataConfig(dir="data"),
                       optim=OptimConfig(decay_steps=80), run=RunConfig(steps=160, dir=str(run)))
    store.save(run.checkpoints, 160, {"model": GPT(SMALL).state_dict()},
               {"config": made.to_dict(), "world_size": 2, "data_fingerprint": "ab" * 32},
               keep=3)
    run.write_config(made.to_dict(), 160, 2)
    given = parsed("--run-dir", str(run), "--run.steps", "164", "--optim.decay-steps", "164")
    launcher = resume.settle(given, resume.choose(given, run, True, "ab" * 32))
    assert (launcher.run.steps, launcher.optim.decay_steps) == (164, 164)
    run.write_config(launcher.to_dict(), 160, 2)
    worker = parsed("--resolved-config", str(run.config), *worker_flags(launcher))
    assert resume.settle(worker, resume.choose(worker, run, True, "ab" * 32)) == launcher

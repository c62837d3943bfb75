"""A run continues from its directory alone: `train --run-dir R` takes the run's config.json (its
data, shape, batch, schedule), flags override it and are recorded, and `--resolved-config
R/config.json` takes flags too. What belongs to one start (--reset, the threads) is not carried
to the next.

The commands run in this process (tests/in_process.py; --nproc's workers are processes still):
what is asserted is what they say and write, not how a process starts."""

import json
import os

import pytest

from ddpgpt.config.commands import PrepareConfig
from ddpgpt.config.optim import OptimConfig
from ddpgpt.data.prepare import main as prepare
from ddpgpt.optim.schedule import lr_at
from tests.conftest import CORPUS, STDLIB
from tests.helpers import read_metrics, tiny_train_args
from tests.in_process import run_in_process

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def _ok(r):
    assert r.returncode == 0, r.stderr
    return r


def test_a_run_continues_from_its_directory_alone(tiny_data, tmp_path):
    """Made with its own --data (byte ids), T=16 of a 32-token block, --reset and one thread,
    in a directory whose default data (data/stdlib) has another tokenizer: continued by
    `train --run-dir R`, then with more steps (at the floor, the schedule ended: said so), then
    by --resolved-config with more again, then with more on a schedule of their own."""
    prepare.run(PrepareConfig(sources=[str(STDLIB / f) for f in CORPUS[:4]],
                              out=str(tmp_path / "data" / "stdlib"), vocab_size=300,
                              val_fraction=0.2))  # the default --data: a bpe of 300 ids
    run = tmp_path / "runs" / "lic"
    made = tiny_train_args(tiny_data, run, steps=4, data__seq_len=16, run__resume="reset")
    _ok(run_in_process(*made[2:], cwd=tmp_path))

    r = _ok(run_in_process("train", "--run-dir", run, cwd=tmp_path))
    last = read_metrics(run)[1][-1]  # its figures as recorded, not the val split scored again
    assert r.stderr == (f"run {run} is already at step 4 of 4 (val_loss {last['val_loss']:.4f}, "
                        f"val_bpb {last['val_bpb']:.4f} at step 4); raise run.steps to train "
                        "further\n")

    r = _ok(run_in_process("train", "--run-dir", run, "--run.steps", "6", cwd=tmp_path))
    assert f"resuming from {run / 'checkpoints' / 'step_0000004'} (step 4," in r.stderr
    # the schedule ended at step 4: the line says what the lr is, and how to get another
    assert ("ddpgpt: resuming with changed settings (applied from step 4): run.steps 4 -> 6; "
            "from step 5: lr 0.001, optim.min_lr, to step 6: the schedule ended at step 4; "
            "--optim.schedule-start 4 trains steps 5-6 on a cosine of their own: lr 0.005 at "
            "step 5, 0.01 at step 6\n" in r.stderr), r.stderr
    assert [x["lr"] for x in read_metrics(run)[0][4:]] == [1e-3, 1e-3]  # a tenth of optim.lr
    assert "--reset" not in r.stderr and not list(run.glob("reset-*"))

    r = _ok(run_in_process("train", "--resolved-config", run / "config.json", "--run.steps", "8",
                           cwd=tmp_path))
    assert "run.steps 6 -> 8; from step 7: lr 0.001, optim.min_lr, to step 8: " in r.stderr
    assert [x["step"] for x in read_metrics(run)[0]] == list(range(1, 9))
    # the advice followed: steps 9-12 on a schedule of their own, as its line says
    r = _ok(run_in_process("train", "--run-dir", run, "--run.steps", "12",
                           "--optim.schedule-start", "8", cwd=tmp_path))
    assert ("changed settings (applied from step 8): optim.decay_steps 4 -> 12, "
            "optim.schedule_start 0 -> 8, run.steps 8 -> 12; from step 9: lr 0.005, on a cosine "
            "of its own: 0.01 at step 10 after its warmup, 0.001 at step 12\n") in r.stderr, \
        r.stderr
    anew = OptimConfig(lr=1e-2, warmup_steps=2, decay_steps=12, schedule_start=8)
    assert [x["lr"] for x in read_metrics(run)[0][8:]] == [lr_at(s, anew, 12)
                                                          for s in range(8, 12)]
    config = json.loads((run / "config.json").read_text())
    # the run's data, T and schedule (its second: steps 9-12); this start's threads
    assert (config["data"]["dir"], config["data"]["seq_len"], config["run"]["steps"],
            config["optim"]["decay_steps"], config["optim"]["schedule_start"],
            config["run"]["threads"]) == (str(tiny_data), 16, 12, 12, 8,
                                          len(os.sched_getaffinity(0)))
    saved = json.loads((run / "configs.jsonl").read_text().splitlines()[-2])["config"]
    assert (saved["run"]["steps"], saved["optim"]["decay_steps"]) == (8, 4)  # kept until then


def test_a_run_continues_on_the_processes_it_last_trained_on(tiny_data, tmp_path):
    """Made on 2 processes (its warmup as long as its 2 steps: said in a line): `train --run-dir
    R` alone continues on 2, and says so, the workers on the schedule's length given (equal to
    run.steps, which the length's auto also gives: given, it is applied all the same); given its
    --data (the command restated), on 1 as any command without --nproc, and that is said too;
    then, last trained on 1, alone on 1 with nothing to say."""
    run = tmp_path / "run"
    r = _ok(run_in_process(*tiny_train_args(tiny_data, run, steps=2)[2:], "--nproc", "2"))
    # a warmup as long as the run: said once (rank 0), the run goes on
    assert r.stderr.count("ddpgpt: warning: optim.warmup_steps = 2 is not shorter than the "
                          "schedule (2 steps, to step 2): the lr only rises, to 0.01 at step 2 "
                          "of a peak of 0.01 (optim.lr), and never decays; give "
                          "--optim.warmup-steps 0 or so") == 1, r.stderr
    # a schedule's length given equal to run.steps: applied by the workers too, recorded once
    r = _ok(run_in_process("train", "--run-dir", run, "--run.steps", "4", "--optim.decay-steps",
                           "4"))
    assert (f"ddpgpt: continuing run {run} on 2 processes, as it last trained (--nproc N for "
            "another number)\n") in r.stderr, r.stderr
    assert "ddpgpt: training on 2 processes" in r.stderr
    assert "optim.decay_steps 2 -> 4, run.steps 2 -> 4; from step 3: lr 0.01\n" in r.stderr
    given = OptimConfig(lr=1e-2, warmup_steps=2, decay_steps=4)
    assert [x["lr"] for x in read_metrics(run)[0][2:]] == [lr_at(s, given, 4) for s in (2, 3)]
    assert lr_at(2, given, 4) == pytest.approx(1e-2)  # the peak, not the old end's floor
    rows = [json.loads(line) for line in (run / "configs.jsonl").open()]
    assert [(x["step"], x["config"]["optim"]["decay_steps"]) for x in rows] == [(0, 2), (2, 4)]
    r = _ok(run_in_process("train", "--run-dir", run, "--data", tiny_data, "--run.steps", "5"))
    assert (f"ddpgpt: run {run} last trained on 2 processes; given --data, this start runs on "
            "1 (--nproc 2 for 2)\n") in r.stderr, r.stderr
    assert "ddpgpt: training on 1 process," in r.stderr
    r = _ok(run_in_process("train", "--run-dir", run, "--run.steps", "6"))
    assert "ddpgpt: training on 1 process," in r.stderr and "processes" not in r.stderr
    worlds = [json.loads(line)["world_size"] for line in (run / "configs.jsonl").open()]
    assert worlds[-3:] == [2, 1, 1]

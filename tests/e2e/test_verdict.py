"""The run's verdict at its end, on real runs (guard/verdict.py, docs/reliability.md): a run
resumed at a learning rate that ruins it ends unhealthy, loudly (a line, an event, exit 3); one
whose spike truly heals (the loss back near the level before it) ends healthy, exit 0; a
mixture changed on purpose is judged on its own losses.

The runs share one start: 20 steps of the tiny model on byte data at lr 3e-2 (its loss ~3.2
against ln 257 = 5.55), on a cosine of 60 steps down to 1e-4, checkpoints every 5, spikes looked
for against the median of the last 5 healthy steps, 5 steps of patience. Each resumes a copy of
it to step 40 at another lr; the mixture's run is its own. The runs train in this process
(tests/in_process.py): the verdict is their output and exit code."""

import json
import shutil

import numpy as np
import pytest

from ddpgpt.guard.health import EXIT_UNHEALTHY
from tests.helpers import tiny_train_args, write_dataset
from tests.in_process import run_in_process

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]
SETTINGS = {"optim__warmup_steps": 3, "optim__decay_steps": 60, "optim__min_lr": 1e-4,
            "run__checkpoint_every": 5, "run__eval_every": 10, "run__spike_window": 5,
            "run__spike_patience": 5}


def train(data, run, steps: int, lr: float):
    args = tiny_train_args(data, run, steps=steps, optim__lr=lr, **SETTINGS)
    return run_in_process(*args[2:])


def rows(run) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def trained(tiny_data, tmp_path_factory):
    run = tmp_path_factory.mktemp("verdict") / "run"
    r = train(tiny_data, run, 20, 3e-2)
    assert r.returncode == 0, r.stderr
    return run


def resumed(trained, tiny_data, tmp_path, lr: float):
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    return run, train(tiny_data, run, 40, lr)


def test_a_run_resumed_at_an_lr_that_ruins_it_ends_unhealthy(trained, tiny_data, tmp_path):
    """lr 50: the loss jumps from ~3 to tens and hundreds; three rollbacks at 25, 12.5 and 6.25
    do not help, the run trains on through it to step 40 (never stopping for a finite spike)
    and its end says it is not healthy: one line, the event, exit 3; no "next:" line. A rerun
    finds it finished, and says both."""
    run, r = resumed(trained, tiny_data, tmp_path, 50)
    assert r.returncode == EXIT_UNHEALTHY, r.stderr
    events = [e for e in rows(run) if "event" in e]
    assert [e["event"] for e in events] == ["config_change", "rollback", "rollback", "rollback",
                                            "spike", "give_up", "unhealthy"]
    ended = events[-1]
    assert (ended["step"], ended["why"], ended["spike_step"]) == (40, "not recovered", 22)
    assert ended["bound"] == pytest.approx(1.1 * ended["median"])
    assert ended["loss_median"] > 3 * ended["bound"]
    vals = {e["step"]: e["val_loss"] for e in rows(run) if "val_loss" in e}
    assert vals[40] > 2 * vals[20] and ended["last_val_loss"] == vals[40]
    last = r.stderr.splitlines()[-1]
    assert last == (
        f"ddpgpt: unhealthy: step 40: the run trained to its end but is not healthy: its loss "
        f"never came back near where it was before the spike at step 22: the median of its last "
        f"5 steps is {ended['loss_median']:.4g}, above {ended['bound']:.4g} (1.1 × the median "
        f"{ended['median']:.4g} before it); val_loss {vals[40]:.4g} against {vals[20]:.4g} "
        f"before it. Its checkpoints are not a trained model. The "
        f"newest healthy checkpoint is {run / 'checkpoints' / 'step_0000020'}: to resume from "
        f"it, run the same command with --resume {run / 'checkpoints' / 'step_0000020'}, and "
        "lower optim.lr"), last
    assert "ddpgpt: next:" not in r.stderr
    assert (run / "checkpoints" / "step_0000040").is_dir()  # written, and said unhealthy
    # the same command again: finished, and still said to be unhealthy, exit 3 again
    again = train(tiny_data, run, 40, 50)
    assert again.returncode == EXIT_UNHEALTHY
    final = [e for e in rows(run) if "val_loss" in e and e["step"] == 40][-1]
    assert again.stderr == (f"run {run} is already at step 40 of 40 (val_loss "
                            f"{final['val_loss']:.4f}, val_bpb {final['val_bpb']:.4f} at step "
                            f"40); raise run.steps to train further\n{last}\n")


def test_a_run_whose_spike_truly_heals_ends_healthy(trained, tiny_data, tmp_path):
    """lr 1: the loss jumps to ~11 at step 22, the weights' doing; trained through, it comes
    back near the median before the spike (at most 1.1 ×) a few steps later: recovered then,
    not at the first step merely under 2 × the median. The run ends healthy: exit 0, the
    "next:" line, no unhealthy event, its val loss back at the level before the spike."""
    run, r = resumed(trained, tiny_data, tmp_path, 1)
    assert r.returncode == 0, r.stderr
    events = [e for e in rows(run) if "event" in e]
    assert [(e["event"], e.get("cause")) for e in events] == [
        ("config_change", None), ("spike", "weights"), ("recovered", None)]
    spike, healed = events[1:]
    assert healed["spike_step"] == spike["step"] == 22
    assert healed["loss_now"] <= healed["bound"] == pytest.approx(1.1 * spike["median"])
    losses = {e["step"]: e["loss"] for e in rows(run) if "loss" in e}
    # the steps between: under 2 × the median (the first is where "recovered" used to be
    # said), but not back near it
    between = [losses[s] for s in range(23, healed["step"])]
    assert between and between[0] < 2 * spike["median"]
    assert all(x > healed["bound"] for x in between)
    vals = {e["step"]: e["val_loss"] for e in rows(run) if "val_loss" in e}
    assert vals[40] <= 1.1 * vals[20]
    assert (f"ddpgpt: warning: step {healed['step']}: recovered: the loss "
            f"{healed['loss_now']:.4g} is back near the median {spike['median']:.4g} before the "
            f"spike at step 22 (at most {healed['bound']:.4g}), trained through") in r.stderr
    assert r.stderr.splitlines()[-1].startswith("ddpgpt: next: ")


def test_a_mixture_changed_on_purpose_starts_the_spike_guard_anew(tiny_data, tmp_path):
    """12 steps of an easy source (one sentence, over and over) at 0.95 and the stdlib's bytes
    at 0.05, then resumed to step 20 with the weights reversed. Each batch of the new mixture is
    far above 2 × the median of the easy one, and the weights still do on the last easy batch:
    the detector took the change for bad data and skipped the new steps, and the end compared
    the new data's losses with the old ones'. Now the change starts the spike window and the
    end's baselines anew, says so, and every new step trains: the stdlib's val loss goes down,
    exit 0."""
    sentence = np.frombuffer(b"the cat sat on the mat. ", dtype=np.uint8)
    easy = write_dataset(tmp_path / "easy", np.tile(sentence, 2000), np.tile(sentence, 100), 257,
                         eot_id=256)
    run = tmp_path / "run"
    settings = {"optim__lr": 2e-2, "optim__decay_steps": 40, "run__eval_every": 12,
                "run__spike_window": 5, "run__checkpoint_every": 0}
    for weights, steps in (((0.95, 0.05), 12), ((0.05, 0.95), 20)):
        args = tiny_train_args(f"{easy}:{weights[0]},{tiny_data}:{weights[1]}", run, steps=steps,
                               **settings)
        r = run_in_process(*args[2:])
        assert r.returncode == 0, r.stderr
    events = [e["event"] for e in rows(run) if "event" in e]
    assert events == ["mixture_change", "config_change"], events
    assert ("from step 13: lr " in r.stderr and "; on the new data, loss spikes and the run's "
            "health are judged against its own losses alone (none is looked for before 5 steps "
            "of them)\n" in r.stderr), r.stderr
    vals = {e["step"]: e["val_loss/tiny"] for e in rows(run) if "val_loss" in e}
    assert vals[20] < vals[12]
    assert r.stderr.splitlines()[-1].startswith("ddpgpt: next: ")

"""The real command line end to end: prepare, train --nproc 2, resume, eval, sample, a deliberate
switch of dataset. Each command runs in this process (tests/in_process.py; --nproc's workers
are processes still) but the first training, started as the console script from a folder that
holds another `ddpgpt`, whose property is the processes' imports. (Two launchers forming one job
through c10d rendezvous, as two nodes would: tests/dist/test_recovery_nodes.py.)"""

import hashlib
import json
import re
import shutil

import pytest
import torch

from tests.conftest import CORPUS, STDLIB
from tests.helpers import read_metrics, tiny_train_args
from tests.in_process import run_in_process
from tests.processes import run_cli

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def test_prepare_train_resume_eval_sample(tmp_path):
    data, run = tmp_path / "data", tmp_path / "run"
    r = run_in_process("prepare", *[STDLIB / f for f in CORPUS], "--out", data, "--tokenizer",
                       "byte", "--val-fraction", "0.2")
    assert r.returncode == 0, r.stderr
    train = tiny_train_args(data, run, steps=4, run__eval_every=2)[3:]  # drop "-m ddpgpt train"

    # Started from a folder that holds another `ddpgpt` (the parent of an older clone): the
    # workers import the package the launcher imported, not that one.
    clones = tmp_path / "clones"
    (clones / "ddpgpt").mkdir(parents=True)
    (clones / "ddpgpt" / "__init__.py").write_text("raise ImportError('not this ddpgpt')\n")
    r = run_cli("train", "--nproc", "2", *train, timeout=180, cwd=clones, console=True)
    assert r.returncode == 0, r.stderr
    assert ("ddpgpt: training on 2 processes (1 node × 2, gloo), cpu, fp32; G=8 sequences × T=32"
            in r.stderr)
    assert r.stderr.count(f"ddpgpt: next: ddpgpt eval --run-dir {run} | ") == 1  # rank 0 alone
    rows, evals = read_metrics(run)
    assert [x["step"] for x in rows] == [1, 2, 3, 4] and [e["step"] for e in evals] == [2, 4]
    assert set(rows[0]) == {"step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s", "mfu",
                            "elapsed_s", "data_wait_s", "ckpt_wait_s"}
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [
        "step_0000003", "step_0000004"]
    # resolved: the byte tokenizer's 257 ids as they are (64 × 5 = 320 would add 25%)
    assert json.loads((run / "config.json").read_text())["model"]["vocab_size"] == 257

    # continue to step 6, with another weight decay: applied, printed once, recorded
    first_config = json.loads((run / "config.json").read_text())
    assert first_config["optim"]["decay_steps"] == 4  # the schedule's length: the first run.steps
    r = run_in_process("train", "--nproc", "2", *train[:-2], "--run.steps", "6",
                       "--optim.weight-decay", "0.5")
    assert r.returncode == 0, r.stderr
    assert (f"resuming from {run / 'checkpoints' / 'step_0000004'} (step 4, saved at world size 2)"
            in r.stderr)
    changed = ("ddpgpt: resuming with changed settings (applied from step 4): "
               "optim.weight_decay 0.1 -> 0.5, run.steps 4 -> 6")
    assert r.stderr.count(changed) == 1, r.stderr
    rows, evals = read_metrics(run)
    assert ([x["step"] for x in rows] == [1, 2, 3, 4, 5, 6]
            and [e["step"] for e in evals] == [2, 4, 6])
    events = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()
              if '"event"' in line]
    assert events == [{"step": 4, "event": "config_change",
                       "checkpoint": str(run / "checkpoints" / "step_0000004"),
                       "changes": {"optim.weight_decay": [0.1, 0.5], "run.steps": [4, 6]}}]
    # Raising run.steps goes on at min_lr (unset: a tenth of optim.lr) instead of re-shaping
    # the cosine up again.
    assert first_config["optim"]["min_lr"] is None
    assert [x["lr"] for x in rows[4:]] == [first_config["optim"]["lr"] / 10] * 2
    starts = [json.loads(line) for line in (run / "configs.jsonl").read_text().splitlines()]
    assert [(s["step"], s["config"]["optim"]["weight_decay"]) for s in starts] == [(0, 0.1),
                                                                                  (4, 0.5)]
    assert starts[0]["config"] == first_config

    r = run_in_process("eval", "--run", run, "--device", "cpu")
    assert r.returncode == 0, r.stderr
    # one process against the training's evaluation at W=2: another reduction order, so the
    # printed 4 decimals agree within their rounding and float tolerance, not character for
    # character
    found = re.fullmatch(r"val_loss (\d+\.\d{4}), val_bpb (\d+\.\d{4}) \(step 6, 16 windows of "
                         r"32 tokens, 1 process\)\n", r.stdout)
    assert found, r.stdout
    for got, key in zip(map(float, found.groups()), ("val_loss", "val_bpb")):
        assert got == pytest.approx(evals[-1][key], abs=5e-5 + 1e-5 * evals[-1][key]), key

    r = run_in_process("sample", "--run", run, "--prompt", "def ", "--max-new-tokens", "40",
                       "--device", "cpu")
    again = run_in_process("sample", "--run", run, "--prompt", "def ", "--max-new-tokens", "40",
                           "--device", "cpu")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("def ") and len(r.stdout) > 20
    assert r.stdout == again.stdout  # seeded


def test_flags_pass_through_torchrun_parser():
    """torchrun's own parser sees every ddpgpt flag after `-m ddpgpt train`; none may look like an
    abbreviation of one of its options (as --run would of --run-path)."""
    from torch.distributed.run import parse_args

    help_text = (run_in_process("train", "--help-all").stdout
                 + run_in_process("eval", "--help").stdout)
    flags = sorted(set(re.findall(r"(?<![\w-])--[a-z][\w.-]*", help_text))
                   - {"--help", "--run", "--nproc", "--max-restarts"})
    assert "--run-dir" in flags and "--optim.lr" in flags
    args = parse_args(["--standalone", "-m", "ddpgpt", "train", *flags])
    assert args.training_script_args == ["train", *flags]


@pytest.mark.parametrize("command", ["sample", "eval"])
def test_sample_and_eval_need_a_checkpoint(tmp_path, command):
    r = run_in_process(command, "--run", tmp_path / "nothing", "--device", "cpu")
    assert r.returncode == 2
    assert r.stderr == (f"ddpgpt: error: run {tmp_path / 'nothing'} has no complete checkpoint; "
                        f"train first (ddpgpt train --run-dir {tmp_path / 'nothing'})\n")


def test_deliberate_switch_of_dataset_is_recorded(tiny_data, tmp_path):
    """Resume on another dataset: refused without --data.allow-switch (see the bad-input table);
    with it the run goes on, the loader starts the new data from its beginning, the loss spike
    guard from the new data's losses, and metrics.jsonl and the changed-settings line say so at
    the step of the switch."""
    run, other = tmp_path / "run", tmp_path / "other"
    shutil.copytree(tiny_data, other)
    meta = json.loads((other / "meta.json").read_text())
    meta["source"]["specs"] = ["another corpus"]
    (other / "meta.json").write_text(json.dumps(meta))
    r = run_in_process(*tiny_train_args(tiny_data, run, steps=2)[2:])
    assert r.returncode == 0, r.stderr
    r = run_in_process(*tiny_train_args(other, run, steps=4)[2:], "--data.allow-switch")
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    event, changed = [row for row in rows if "event" in row]
    assert changed == {"step": 2, "event": "config_change",
                       "checkpoint": str(run / "checkpoints" / "step_0000002"),
                       "changes": {"data.dir": [str(tiny_data), str(other)],
                                   "run.steps": [2, 4]}}  # the flag is this start's own
    assert event == {"step": 2, "event": "data_switch",
                     "checkpoint": str(run / "checkpoints" / "step_0000002"),
                     "old": hashlib.sha256((tiny_data / "meta.json").read_bytes()).hexdigest(),
                     "new": hashlib.sha256((other / "meta.json").read_bytes()).hexdigest(),
                     "data_dir": str(other)}
    assert [row["step"] for row in rows if "loss" in row] == [1, 2, 3, 4]
    state = torch.load(run / "checkpoints" / "step_0000004" / "trainer.pt", weights_only=True)
    # 2 steps of G=8 on the new data
    assert (state["loader"]["epoch"], state["loader"]["consumed"]) == (0, 2 * 8)
    spikes = state["guard"]["spike"]  # its first loss, and every one it compares, the new data's
    assert (spikes["first"][1], len(spikes["losses"]), len(spikes["lately"])) == (3, 2, 2)
    assert r.stderr.count("; on the new data, loss spikes and the run's health are judged "
                          "against its own losses alone (none is looked for before 10 steps of "
                          "them)\n") == 1


@pytest.mark.parametrize("nproc", [1, 2])
def test_ctrl_c_through_tee_still_checkpoints(tiny_data, tmp_path, nproc):
    """`train ... 2>&1 | tee log`, then Ctrl-C: SIGINT reaches the whole foreground group, tee
    included, so the stop message and the progress bar meet a closed pipe. The run must still
    stop at a step boundary with its checkpoint (exit 75), and say so in metrics.jsonl, where
    the pipe cannot lose it."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from tests.processes import kill_tree

    run = tmp_path / "run"
    args = tiny_train_args(tiny_data, run, steps=400, run__checkpoint_every=0)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    def as_a_shell_starts_it():  # a terminal's foreground job: Ctrl-C's default action, even
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # when this suite itself runs with SIGINT
        # ignored (a background job of a non-interactive shell inherits it ignored)

    train = subprocess.Popen([sys.executable, *args, "--nproc", str(nproc)],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                             process_group=0,  # a foreground job: one group, tee joins it
                             preexec_fn=as_a_shell_starts_it)
    tee = subprocess.Popen(["tee", str(tmp_path / "log")], stdin=train.stdout,
                           stdout=subprocess.DEVNULL, process_group=train.pid,
                           preexec_fn=as_a_shell_starts_it)
    train.stdout.close()  # tee is the pipe's only reader
    try:
        deadline = time.monotonic() + 120
        while len(read_metrics(run)[0] if (run / "metrics.jsonl").is_file() else []) < 3:
            assert train.poll() is None and time.monotonic() < deadline, "no step was logged"
            time.sleep(0.05)
        os.killpg(train.pid, signal.SIGINT)  # Ctrl-C: the whole foreground group
        code = train.wait(timeout=120)
    finally:
        kill_tree(train.pid)
        tee.kill()
    assert tee.wait() == -signal.SIGINT
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    (stop,) = [r for r in rows if r.get("event") == "stop"]
    step = stop["step"]
    assert code == 75 and stop["exit_code"] == 75, (code, rows[-3:])
    assert stop["message"].startswith(f"at step {step} on SIGINT; checkpoint ")
    assert (run / "checkpoints" / f"step_{step:07d}" / "meta.json").is_file()
    assert 3 <= step < 400

"""What a person at a terminal sees of a run, read from a real terminal (a pty): the lr on the
step line, status lines written above the progress bar and never over it, a sample every N steps
(the text `ddpgpt sample` gives from that step's checkpoint, drawn without touching the training's
RNG: the run stays bitwise the same), and the final evaluation's own bars after the training's
bar has closed. `eval --threads`.

One module-scoped story: a run of 2 steps with dropout (so the global RNG matters), continued to
4 in a pty with a sample after every step, and the same 4 steps straight, without samples."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import struct
import subprocess
import sys
import termios
from types import SimpleNamespace

import pytest
import torch

from tests.helpers import REPO, read_metrics, tiny_train_args
from tests.processes import kill_tree, run_cli

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]
PROMPT = "def "


def in_terminal(argv: list[str], cwd, timeout: float = 180) -> tuple[int, str]:
    """Runs `python ARGV` with its stdin, stdout and stderr on a pty of 160 columns; returns its
    exit code and everything it wrote, as the terminal received it."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))
    proc = subprocess.Popen([sys.executable, *map(str, argv)], stdin=slave, stdout=slave,
                            stderr=slave, cwd=cwd, start_new_session=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1",
                                 "PYTHONPATH": str(REPO)})
    os.close(slave)
    out = bytearray()
    try:
        while True:
            try:
                chunk = os.read(master, 1 << 16)
            except OSError:  # EIO: every writer has closed the terminal
                break
            if not chunk:
                break
            out += chunk
        code = proc.wait(timeout=timeout)
    except BaseException:
        kill_tree(proc.pid)
        raise
    finally:
        os.close(master)
    return code, out.decode("utf-8", "replace")


@pytest.fixture(scope="module")
def console(tiny_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("console")
    run, straight = root / "run", root / "straight"
    # the schedule of 4 steps from the start: a run of 2 continued to 4 would otherwise hold
    # min_lr after its schedule ended, and differ from the straight run by the lr
    flags = dict(model__dropout=0.1, optim__decay_steps=4)
    made = run_cli(*tiny_train_args(tiny_data, run, steps=2, **flags)[2:], timeout=120)
    assert made.returncode == 0, made.stderr
    code, shown = in_terminal(["-m", "ddpgpt", "train", "--run-dir", run, "--run.steps", "4",
                               "--run.sample-every", "1", "--run.sample-prompt", PROMPT], root)
    assert code == 0, shown
    done = run_cli(*tiny_train_args(tiny_data, straight, steps=4, **flags)[2:], timeout=120)
    assert done.returncode == 0, done.stderr
    return SimpleNamespace(root=root, run=run, straight=straight, shown=shown)


def test_samples_leave_the_training_bitwise_as_it_was(console):
    """Steps 3-4 sampled after each, after a resume: the straight run's losses, bitwise, with
    dropout drawing from the global RNG all along."""
    assert [r["loss"] for r in read_metrics(console.run)[0]] == \
        [r["loss"] for r in read_metrics(console.straight)[0]]


def test_a_sample_is_what_ddpgpt_sample_gives_from_that_steps_checkpoint(console):
    sampled = run_cli("sample", "--run-dir", console.straight, "--prompt", PROMPT,
                      "--max-new-tokens", "64", "--device", "cpu", timeout=120)
    assert sampled.returncode == 0, sampled.stderr
    text = sampled.stdout.removesuffix("\n")
    assert text.startswith(PROMPT) and len(text) > len(PROMPT)
    # the terminal shows each newline as \r\n
    assert f"step 4: sample: {text}\n" in console.shown.replace("\r\n", "\n")
    assert console.shown.count("step 3: sample: ") == 1


def test_status_lines_are_written_above_the_bar(console):
    """Every line said while the bar is drawn comes after a carriage return that took the bar
    away, never straight after the bar's text; the step line holds the lr."""
    shown = console.shown
    for line in ("ddpgpt: resuming with changed settings", "step 3: sample: ",
                 "step 4: sample: "):
        before = shown.split(line)[0]
        assert before.endswith("\r"), repr(before[-160:])
    assert re.search(r"train: 100%\|.*loss=\d\.\d{4}, lr=0\.00\d+, tok_s=", shown), shown


def test_the_final_evaluation_has_its_own_bars_after_the_training_bar(console):
    """The training's bar is closed (its line ended) before the evaluation's bars start."""
    shown = console.shown
    last_train, first_val = shown.rfind("train: 100%"), shown.find("val:")
    assert 0 < last_train < first_val, shown
    assert "\r\n" in shown[last_train:first_val]
    assert shown.find("train sample:") > first_val
    assert shown.find("step 4: val_loss") > shown.rfind("train sample: 100%")


def test_eval_takes_its_threads(console, capsys):
    from ddpgpt import cli

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        cli.main(["eval", "--run-dir", str(console.straight), "--device", "cpu", "--threads",
                  "1"])
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)
    assert capsys.readouterr().out.startswith("val_loss ")

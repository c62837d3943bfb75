"""tests/in_process.py: a command run in the test's process says and exits as `python -m ddpgpt`
does, and leaves the process as it found it."""

from __future__ import annotations

import logging
import os
import signal
import sys

import pytest
import torch

from ddpgpt import cli
from tests.helpers import tiny_train_args
from tests.in_process import flushes_denormals, run_in_process
from tests.processes import run_cli


def _same(args, **kwargs):
    """The subprocess's (exit code, stdout, stderr) and the in-process call's are equal."""
    proc, here = run_cli(*args, **kwargs), run_in_process(*args, **kwargs)
    assert (here.returncode, here.stdout, here.stderr) == \
        (proc.returncode, proc.stdout, proc.stderr)
    return here


def test_a_command_that_succeeds_says_the_same(tmp_path):
    """train --print-config: the whole resolved config on stdout, exit 0."""
    r = _same(["train", "--preset", "tiny", "--print-config", "--run-dir", tmp_path / "run"])
    assert r.returncode == 0 and "[model]" in r.stdout and r.stderr == ""


def test_bad_input_says_the_same_line(tmp_path):
    """A bad value: one line, exit 2; an unknown command: its line (with the environment and the
    working directory given), exit 2."""
    args = tiny_train_args(tmp_path / "data", tmp_path / "run", run__steps="ten")[2:]
    r = _same(args)
    assert r.returncode == 2 and r.stderr == ("ddpgpt: error: command line: run.steps: "
                                              "expected an integer, got 'ten'\n"), r.stderr
    r = _same(["trian"], env={"DDPGPT_DEBUG": "0"}, cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.startswith("ddpgpt: error: unknown command 'trian' (did "
                                                     "you mean train?)"), r.stderr
    assert not (tmp_path / "run").exists()


def test_what_a_command_changes_is_put_back(tmp_path, monkeypatch):
    """A command that sets threads, dtype, RNG, environment, directory, signal handlers, a
    logger, sys.argv, and writes from C (fd 2) and Python before exiting 3: its output and code
    come back, and the process is as it was."""
    def command(argv):
        torch.set_num_threads(threads + 1)
        torch.set_default_dtype(torch.float64)
        torch.manual_seed(123)
        os.environ["DDPGPT_IN_PROCESS_PROBE"] = argv[0]
        del os.environ["DDPGPT_PROBE_GONE"]
        os.chdir(tmp_path)
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
        logging.getLogger("ddpgpt.probe").setLevel(logging.CRITICAL)
        logging.getLogger("ddpgpt.probe").addHandler(logging.NullHandler())
        sys.path.append(str(tmp_path))
        torch.set_flush_denormal(not denormals)  # as a training sets it
        print("out", os.environ["DDPGPT_GIVEN"], sys.argv[1:])
        os.write(2, b"from C\n")
        print("from Python", file=sys.stderr)
        sys.exit(3)

    monkeypatch.setenv("DDPGPT_PROBE_GONE", "1")
    logging.getLogger("ddpgpt.probe").setLevel(logging.INFO)
    threads, here, path = torch.get_num_threads(), os.getcwd(), sys.path[:]
    environ, handler = dict(os.environ), signal.getsignal(signal.SIGUSR1)
    rng, denormals = torch.get_rng_state(), flushes_denormals()  # a training before may set it
    monkeypatch.setattr(cli, "main", command)
    r = run_in_process("probe", 1, env={"DDPGPT_GIVEN": "given"})
    assert (r.returncode, r.stdout, r.stderr) == (3, "out given ['probe', '1']\n",
                                                  "from C\nfrom Python\n")
    assert torch.get_num_threads() == threads and torch.get_default_dtype() == torch.float32
    assert torch.equal(torch.get_rng_state(), rng) and flushes_denormals() == denormals
    assert dict(os.environ) == environ and os.getcwd() == here and sys.path == path
    assert signal.getsignal(signal.SIGUSR1) == handler
    probe = logging.getLogger("ddpgpt.probe")
    assert probe.level == logging.INFO and probe.handlers == []


def test_a_bug_is_a_traceback_and_exit_1(monkeypatch):
    """An uncaught exception: its traceback on stderr and exit 1, as the interpreter does."""
    def command(argv):
        raise RuntimeError("a bug")

    monkeypatch.setattr(cli, "main", command)
    r = run_in_process("eval")
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.startswith("Traceback") and r.stderr.endswith("RuntimeError: a bug\n")


@pytest.mark.parametrize("code", [None, 0, "a message"])
def test_exit_codes_as_the_interpreter_gives_them(code, monkeypatch):
    monkeypatch.setattr(cli, "main", lambda argv: sys.exit(code))
    r = run_in_process("x")
    assert (r.returncode, r.stderr) == ((1, "a message\n") if code else (0, ""))


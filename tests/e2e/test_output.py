"""What `train` prints where a person reads it: a log file gets whole lines (no carriage returns,
no blank lines around `step N:`), a short run no note about rollbacks, a long one without
checkpoints the note, and --compile a line before its slow first step and none of dynamo's
profiler notes."""

import os
import subprocess
import sys

import pytest

from tests.helpers import tiny_train_args
from tests.in_process import run_in_process
from tests.processes import kill_tree

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]
NOTE = "ddpgpt: note: no checkpoint before step"


def logged(args: list[str], timeout: float = 120) -> str:
    """`python ARGS > log 2>&1`: stdout and stderr into one file, as a batch job's log."""
    proc = subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        out, _ = proc.communicate(timeout=timeout)
    except BaseException:
        kill_tree(proc.pid)
        raise
    assert proc.returncode == 0, out
    return out


def test_a_log_file_gets_whole_lines(tiny_data, tmp_path):
    out = logged(tiny_train_args(tiny_data, tmp_path / "run", steps=4, run__eval_every=2))
    lines = out.split("\n")
    assert "\r" not in out and lines[-1] == "", repr(out)
    assert [line for line in lines[:-1] if not line.strip()] == [], repr(out)
    assert sum(line.startswith("step ") and ": val_loss " in line for line in lines) == 2
    assert NOTE not in out  # 4 steps: nothing worth a note


def test_the_rollback_note_is_for_runs_longer_than_the_checkpoint_period(tiny_data, tmp_path):
    """101 steps with no checkpoint before the end: a spike that does not heal would cost them."""
    r = run_in_process(*tiny_train_args(tiny_data, tmp_path / "run", steps=101,
                                        run__checkpoint_every=0, run__eval_every=0,
                                        data__eval_windows=2)[2:])
    assert r.returncode == 0, r.stderr
    assert (f"{NOTE} 101 (run.checkpoint_every = 0): a loss spike the model does not heal from "
            "can only roll back to the start\n") in r.stderr


def test_compile_says_its_first_step_waits_and_no_profiler_note(tiny_data, tmp_path):
    """Two processes (DDP's forward opens a profiler range that dynamo leaves out, and says so
    on every compile), one step."""
    out = logged([*tiny_train_args(tiny_data, tmp_path / "run", steps=1, run__eval_every=0,
                                   data__eval_windows=2), "--compile", "--nproc", "2"],
                 timeout=280)
    assert ("ddpgpt: the first step waits for torch.compile (run.compile: tens of seconds); the "
            "compiled kernels are cached for later runs\n") in out
    assert "Profiler" not in out and "record_function" not in out, out


def test_rows_packed_from_one_document_are_said_once(tmp_path):
    """data.align bos on byte data with no end-of-text token: every row is a slice of one
    document and the document mask does nothing. One warning at W=2, from rank 0 alone (when it
    is said: tests/unit/test_packing.py)."""
    import numpy as np

    from tests.helpers import write_dataset

    rng = np.random.default_rng(0)
    data = write_dataset(tmp_path / "data", rng.integers(1, 256, 4000), rng.integers(1, 256, 800),
                         vocab_size=257, eot_id=256)
    out = logged([*tiny_train_args(data, tmp_path / "run", steps=1, data__align="bos",
                                   data__eval_windows=2), "--nproc", "2"], timeout=280)
    note = (f"ddpgpt: warning: data.align bos: the train split of dataset {data} is one document "
            "(no end-of-text token, id 256, between its tokens), so every row is a slice of it "
            "and model.doc_mask masks nothing; prepare the data with its documents apart (ddpgpt "
            "prepare puts an end-of-text token before each), or use --data.align stream\n")
    assert out.count(note) == 1, out

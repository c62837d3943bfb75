"""`ddpgpt eval` scores the data the run trained on, or other data on purpose: the run's data dir
replaced since (another corpus under the same tokenizer) is refused in one line, as a resume
would be, and `--data DIR` evaluates on it; data of another tokenizer is one line too, never a
traceback, `--data` or not."""

import hashlib
import shutil

import numpy as np
import pytest

from tests.conftest import CORPUS, STDLIB
from tests.helpers import tiny_train_args, write_dataset
from tests.in_process import run_in_process

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def replaced(tiny_data, tmp_path_factory):
    """A run trained 2 steps on a copy of tiny_data in DIR, then DIR replaced by another corpus
    prepared with the same (byte) tokenizer; and a dataset of GPT-2 ids."""
    from ddpgpt.config.commands import PrepareConfig
    from ddpgpt.data.prepare import main as prepare

    root = tmp_path_factory.mktemp("eval")
    data, run = root / "data", root / "run"
    shutil.copytree(tiny_data, data)
    r = run_in_process(*tiny_train_args(data, run, steps=2)[2:])
    assert r.returncode == 0, r.stderr
    shutil.rmtree(data)
    prepare.run(PrepareConfig(sources=[str(STDLIB / f) for f in reversed(CORPUS)], out=str(data),
                              tokenizer="byte", val_fraction=0.3))
    ids = np.random.default_rng(0).integers(0, 50257, 4000)
    gpt2 = write_dataset(root / "gpt2", ids, ids[:1000], 50257, eot_id=50256, kind="gpt2")
    return run, data, gpt2


def one_line(r) -> str:
    assert r.returncode == 2 and r.stdout == "" and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.splitlines()) == 1, r.stderr
    return r.stderr


def fingerprint(data) -> str:
    return hashlib.sha256((data / "meta.json").read_bytes()).hexdigest()[:12]


def test_eval_refuses_data_replaced_since_the_run_trained(replaced, tiny_data):
    run, data, _ = replaced
    line = one_line(run_in_process("eval", "--run-dir", run, "--device", "cpu"))
    assert line == (f"ddpgpt: error: checkpoint {run / 'checkpoints' / 'step_0000002'} was "
                    f"trained on other data (fingerprint {fingerprint(tiny_data)}) than {data} "
                    f"holds now ({fingerprint(data)}): it was replaced or prepared again since; "
                    f"pass --data {data} to evaluate on it anyway\n")


def test_eval_data_evaluates_on_other_data_on_purpose(replaced):
    run, data, _ = replaced
    r = run_in_process("eval", "--run-dir", run, "--device", "cpu", "--data", str(data))
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("val_loss ") and r.stdout.endswith(f"1 process, on {data})\n")


def test_eval_refuses_data_of_another_tokenizer_in_one_line(replaced):
    """--data on purpose or not: GPT-2 ids under a byte-level model (an IndexError from the
    embedding and a traceback, before)."""
    run, _, gpt2 = replaced
    line = one_line(run_in_process("eval", "--run-dir", run, "--device", "cpu", "--data",
                                   str(gpt2)))
    assert line == (f"ddpgpt: error: checkpoint {run / 'checkpoints' / 'step_0000002'} was "
                    f"trained with another tokenizer (byte) than the one of {gpt2} (gpt2, 50257 "
                    "ids): its ids would mean other text; evaluate on data prepared with the "
                    f"run's tokenizer (ddpgpt prepare SOURCES --tokenizer-from {run} --out DIR, "
                    "then --data DIR)\n")

"""Fixtures shared by several files of tests/e2e, each built once a session: the bpe data; the bpe
run of tests/e2e/test_hf_export.py and tests/e2e/test_hf_gpt2.py; a bpe run whose checkpoints
are at a URL of object storage (tests/e2e/test_run_url.py)."""

from __future__ import annotations

import shutil
from types import SimpleNamespace

import pytest

from ddpgpt.config.commands import PrepareConfig
from ddpgpt.data.prepare import main as prepare
from tests.e2e.hf_runs import DOCS, SHAPE, SMALL, STDLIB, _ok
from tests.in_process import run_in_process


@pytest.fixture(scope="session")
def bpe_data(tmp_path_factory):
    """Six standard-library files as a bpe dataset of 300 ids."""
    data = tmp_path_factory.mktemp("bpe-data") / "data"
    prepare.run(PrepareConfig(sources=[str(STDLIB / d) for d in DOCS], out=str(data),
                              vocab_size=300, val_fraction=0.3))
    return data


@pytest.fixture(scope="session")
def bpe(bpe_data, tmp_path_factory):
    """bpe data; a run of 4 steps (checkpoints 2, 4) whose step-4 checkpoint is then lost, as
    in a crash, and which resumes from step 2 to 6; its export."""
    root = tmp_path_factory.mktemp("bpe")
    data, run, out = bpe_data, root / "run", root / "exported"
    args = ["train", "--data", data, "--run-dir", run, *SHAPE, *SMALL, "--run.eval-every", "2",
            "--run.checkpoint-every", "2", "--run.tracker", "tensorboard"]
    _ok(run_in_process(*args, "--run.steps", "4"))
    shutil.rmtree(run / "checkpoints" / "step_0000004")
    resumed = _ok(run_in_process(*args, "--run.steps", "6"))
    assert "resuming from" in resumed.stderr and "(step 2," in resumed.stderr
    export = _ok(run_in_process("export", "--run-dir", run, "--out", out))
    return SimpleNamespace(data=data, run=run, out=out, export=export)


@pytest.fixture(scope="session")
def bpe_at_url(bpe_data, s3_server, tmp_path_factory):
    """A bpe run of 2 steps (an evaluation and a checkpoint at step 2) whose checkpoints are at a
    URL of the session's S3 server (run.checkpoint_url): its local run dir and the URL, both
    named `bpe`."""
    run, url = tmp_path_factory.mktemp("at-url") / "bpe", s3_server.bucket("run") + "/bpe"
    _ok(run_in_process("train", "--data", bpe_data, "--run-dir", run, *SHAPE, *SMALL,
                       "--run.steps", "2", "--run.eval-every", "2", "--run.checkpoint-every", "2",
                       "--run.checkpoint-url", url, env=s3_server.env()))
    return SimpleNamespace(run=run, url=url)

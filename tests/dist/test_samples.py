"""run.sample_every where the sync mode shards the weights (fsdp2): every forward all-gathers
them, so every rank samples alike and rank 0 alone prints; the training is bitwise the run's
without samples (the rank-0-only path, and a resume, are tests/e2e/test_console.py's)."""

import pytest

from tests.helpers import read_metrics, tiny_train_args
from tests.processes import run_cli

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]


def test_fsdp2_samples_on_every_rank_and_trains_as_without(tiny_data, tmp_path):
    runs = {}
    for name, extra in (("plain", []), ("sampled", ["--run.sample-every", "2"])):
        args = tiny_train_args(tiny_data, tmp_path / name, steps=4, model__dropout=0.1,
                               run__sync="fsdp2")
        r = run_cli(*args[2:], "--nproc", "2", *extra, timeout=240)
        assert r.returncode == 0, r.stderr
        runs[name] = r
    assert [r["loss"] for r in read_metrics(tmp_path / "sampled")[0]] == \
        [r["loss"] for r in read_metrics(tmp_path / "plain")[0]]
    err = runs["sampled"].stderr
    assert err.count("step 2: sample: ") == 1 and err.count("step 4: sample: ") == 1, err

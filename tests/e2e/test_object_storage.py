"""The command line with datasets and checkpoints in object storage, against a real S3 server
(moto's, tests/s3.py): a training from and to S3 is the local training, bitwise; a new machine
goes on from the URL alone at another W, with the run's metrics so far; prepare --out URL gives
the local prepare's bytes, also after a kill mid-upload; the server gone mid-upload never
publishes a checkpoint and the same command resumes. (eval, sample, export and plot of a URL:
tests/e2e/test_run_url.py.)"""

from __future__ import annotations

import json
import os
import signal
import sys

import numpy as np
import pytest
import torch

from ddpgpt.checkpoint import location, read
from tests.conftest import CORPUS, STDLIB
from tests.helpers import read_metrics, saved_weights, tiny_train_args
from tests.in_process import run_in_process
from tests.processes import Launch
from tests.s3 import Cut

pytestmark = [pytest.mark.e2e, pytest.mark.dist, pytest.mark.timeout(300)]
STEPS, FIRST = 8, 6


def train(data, run_dir, steps, *extra, nproc=2, env=None):
    args = tiny_train_args(data, run_dir, steps, optim__decay_steps=STEPS,
                           run__checkpoint_every=2)[3:]
    launch = ["--nproc", str(nproc)] if nproc else []
    return run_in_process("train", *args, *launch, *extra, env=env)


@pytest.fixture(scope="module")
def straight(tiny_data, tmp_path_factory):
    """The reference: 8 steps at W=2 on the local dataset, checkpoints in the run dir."""
    run_dir = tmp_path_factory.mktemp("straight") / "run"
    out = train(tiny_data, run_dir, STEPS)
    assert out.returncode == 0, out.stderr
    return run_dir


@pytest.fixture(scope="module")
def in_s3(s3_server, s3_dataset, tmp_path_factory):
    """6 of the 8 steps at W=2, the dataset in S3 and the checkpoints to S3."""
    run_dir, url = tmp_path_factory.mktemp("s3run") / "run", s3_server.bucket("ckpt") + "/run"
    out = train(s3_dataset, run_dir, FIRST, "--run.checkpoint-url", url, env=s3_server.env())
    assert out.returncode == 0, out.stderr
    return run_dir, url


def test_a_run_from_and_to_s3_is_the_local_run(s3, in_s3, straight):
    run_dir, url = in_s3
    rows, ref = read_metrics(run_dir)[0], read_metrics(straight)[0]
    assert [r["loss"] for r in rows] == [r["loss"] for r in ref[:FIRST]]
    assert not (run_dir / "checkpoints").exists()
    listed = sorted(p.rsplit("/", 1)[-1] for p in s3.fs().ls(url[5:]))
    assert listed == ["config.json", "configs.jsonl", "data_meta.json", "job.json",
                      "metrics.jsonl", "step_0000002", "step_0000004", "step_0000006"]
    for name in ("config.json", "configs.jsonl", "metrics.jsonl"):  # as of the last checkpoint
        assert s3.fs().cat_file(f"{url[5:]}/{name}") == (run_dir / name).read_bytes(), name
    weights = read.weights(location.at(f"{url}/step_{FIRST:07d}"))
    ref_weights = saved_weights(straight / "checkpoints" / f"step_{FIRST:07d}")
    assert all(torch.equal(weights[k], ref_weights[k]) for k in ref_weights)


def test_a_new_machine_goes_on_from_the_url_alone_at_another_w(s3, in_s3, straight, tmp_path):
    """An empty run dir, nothing but the URL: the run's config, the newest checkpoint and its
    metrics so far, W=1 (by --nproc 1: alone it would go on on the 2 processes that saved it);
    the straight W=2 run's losses within float rounding. (eval, sample, export and plot of a
    URL: tests/e2e/test_run_url.py.)"""
    _, url = in_s3
    new = tmp_path / "elsewhere"
    out = run_in_process("train", "--run-dir", new, "--run.checkpoint-url", url, "--run.steps",
                         STEPS, "--nproc", 1)
    assert out.returncode == 0, out.stderr
    assert f"resuming from {url}/step_0000006 (step 6, saved at world size 2)" in out.stderr
    assert "resuming with changed settings" in out.stderr and "run.dir" not in out.stderr
    rows, ref = read_metrics(new)[0], read_metrics(straight)[0]
    assert rows[:FIRST] == read_metrics(in_s3[0])[0]  # the history, from the URL
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    np.testing.assert_allclose([r["loss"] for r in rows[FIRST:]],
                               [r["loss"] for r in ref[FIRST:]], rtol=0, atol=1e-5)


def test_the_server_gone_mid_upload_publishes_nothing_and_the_run_resumes(
        s3, s3_data, straight, tmp_path):
    """A relay between the run and the server is cut as step 4's first shard is uploaded: the
    run stops with one line naming step 4 and the intact step 2; step 4 has no meta.json; the
    same command, the server back, resumes from step 2 and ends with the straight run's losses."""
    url, run_dir = s3.bucket("cut") + "/run", tmp_path / "run"
    cut = Cut(s3, when=b"step_0000004/__")
    out = train(s3_data, run_dir, STEPS, "--run.checkpoint-url", url,
                env={"AWS_ENDPOINT_URL": cut.endpoint, "AWS_MAX_ATTEMPTS": "2"})
    assert cut.severed.is_set()
    assert out.returncode == 1, out.stderr
    errors = [line for line in out.stderr.splitlines() if line.startswith("ddpgpt: error:")]
    assert len(errors) == 1 and "Traceback" not in out.stderr, out.stderr
    assert errors[0].startswith(f"ddpgpt: error: step 4: cannot write checkpoint "
                                f"{url}/step_0000004: "), errors[0]
    assert f"cannot reach the S3 endpoint {cut.endpoint}" in errors[0]
    assert errors[0].endswith("; what was uploaded of it has no meta.json and is never loaded. "
                              "The last complete checkpoint (step 2) is intact: wait until the "
                              "storage answers, then run the same command to resume"), errors[0]
    assert not s3.fs().exists(f"{url[5:]}/step_0000004/meta.json")
    again = train(s3_data, run_dir, STEPS, "--run.checkpoint-url", url)
    assert again.returncode == 0, again.stderr
    assert f"resuming from {url}/step_0000002 (step 2" in again.stderr
    rows, ref = read_metrics(run_dir)[0], read_metrics(straight)[0]
    assert [r["loss"] for r in rows[-6:]] == [r["loss"] for r in ref[2:]]
    weights = read.weights(location.at(f"{url}/step_{STEPS:07d}"))
    ref_weights = saved_weights(straight / "checkpoints" / f"step_{STEPS:07d}")
    assert all(torch.equal(weights[k], ref_weights[k]) for k in ref_weights)


# ---- prepare --out URL ------------------------------------------------------------------------

def prepare_args(out):
    return ["prepare", *[str(STDLIB / f) for f in CORPUS], "--tokenizer", "byte",
            "--val-fraction", "0.2", "--shard-tokens", "20000", "--out", str(out)]


def test_prepare_to_s3_uploads_the_local_bytes_meta_json_last_even_after_a_kill(
        s3, tmp_path):
    """prepare --out URL SIGKILLed as its second shard goes up, then the same command: the
    objects are the local prepare's files, byte for byte, and meta.json came last."""
    local = tmp_path / "local"
    assert run_in_process(*prepare_args(local)).returncode == 0
    url = s3.bucket("prep") + "/tiny"
    env = {"DDPGPT_CACHE_DIR": str(tmp_path / "cache")}
    cut = Cut(s3, when=b"train_000001.bin")
    job = Launch([sys.executable, "-m", "ddpgpt", *prepare_args(url)],
                 env={**env, "AWS_ENDPOINT_URL": cut.endpoint})
    cut.on_sever = lambda: os.kill(job.proc.pid, signal.SIGKILL)
    assert job.wait(120) == -signal.SIGKILL, job.text
    fs = s3.fs()
    assert not fs.exists(f"{url[5:]}/meta.json")
    again = run_in_process(*prepare_args(url), env=env)
    assert again.returncode == 0, again.stderr
    assert "continuing the upload" in again.stdout, again.stdout
    for path in local.iterdir():
        if path.name != "verified.json":
            assert fs.cat_file(f"{url[5:]}/{path.name}") == path.read_bytes(), path.name
    modified = {p.rsplit("/", 1)[-1]: fs.info(p)["LastModified"] for p in fs.ls(url[5:])}
    assert modified["meta.json"] == max(modified.values())
    verified = run_in_process("prepare", "--verify", url)
    assert verified.returncode == 0 and verified.stdout.startswith(f"{url}: ok ("), verified


def test_parts_prepared_to_s3_merge_into_the_local_prepare(s3, tmp_path):
    """Two --part I/2 prepares uploaded (part.json last), then --merge of the URLs' glob: the
    dataset's objects are the one-machine prepare's files."""
    local = tmp_path / "local"
    assert run_in_process(*prepare_args(local)).returncode == 0
    base, env = s3.bucket("parts"), {"DDPGPT_CACHE_DIR": str(tmp_path / "cache")}
    for i in (1, 2):
        out = run_in_process(*prepare_args(f"{base}/parts/{i}"), "--part", f"{i}/2", env=env)
        assert out.returncode == 0, out.stderr
    merged = run_in_process("prepare", "--merge", f"{base}/parts/*", "--out", f"{base}/merged",
                            env={"DDPGPT_CACHE_DIR": str(tmp_path / "elsewhere")})
    assert merged.returncode == 0, merged.stderr
    fs = s3.fs()
    for path in local.iterdir():
        if path.name not in ("verified.json", "meta.json"):
            assert fs.cat_file(f"{base[5:]}/merged/{path.name}") == path.read_bytes(), path.name
    meta = json.loads(fs.cat_file(f"{base[5:]}/merged/meta.json"))
    assert meta["shards"] == json.loads((local / "meta.json").read_text())["shards"]

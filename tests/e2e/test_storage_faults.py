"""Object storage's faults and bad input, each one line on the command line with nothing lost:
an unknown bucket, no credentials, wrong ones, a wrong endpoint, no permission to write, a
dataset prefix without meta.json; the server gone between two checkpoints (a relay cut:
tests/s3.py's Cut). Credentials are enforced by a second S3 server (moto's, with IAM: a writer
and a reader-only user)."""

from __future__ import annotations

import re

import pytest

from ddpgpt import cli
from tests.helpers import tiny_train_args
from tests.in_process import run_in_process
from tests.processes import free_port
from tests.s3 import Cut, S3Server

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]
ENDPOINT = r"the S3 endpoint http://127\.0\.0\.1:\d+"
CREDENTIALS = ("the credentials (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or "
               "~/.aws/credentials) are wrong, or may not")


@pytest.fixture(scope="module")
def guarded(tmp_path_factory, tiny_data):
    """A server that checks every request's signature and policy; a bucket with the tiny
    dataset, uploaded by the writer."""
    server = S3Server.start(tmp_path_factory.mktemp("guarded"), auth=True)
    try:
        fs = server.fs(server.writer)
        url = server.bucket("guarded")
        for name in ("train_000000.bin", "val_000000.bin", "meta.json"):
            fs.put_file(str(tiny_data / name), f"{url[5:]}/tiny/{name}")
        yield server, url
    finally:
        server.stop()


def fails(args, env, code=2) -> str:
    out = run_in_process(*args, env=env)
    lines = [line for line in out.stderr.splitlines() if line.startswith("ddpgpt:")]
    assert out.returncode == code and len(lines) == 1, out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    return lines[0]


def train(data, tmp_path, *extra, steps=2):
    return ["train", *tiny_train_args(data, tmp_path / "run", steps)[3:], *extra]


def test_an_unknown_bucket_for_the_data_or_the_checkpoints(s3, s3_data, tmp_path):
    line = fails(train("s3://no-such-bucket/tiny", tmp_path), s3.env())
    assert re.fullmatch(rf"ddpgpt: error: listing s3://no-such-bucket/tiny: the bucket "
                        rf"no-such-bucket does not exist at {ENDPOINT}; create it, or fix the URL "
                        r"\(or AWS_ENDPOINT_URL\)", line), line
    for args in (train(s3_data, tmp_path, "--run.checkpoint-url", "s3://no-such-bucket/run"),
                 ["train", "--run-dir", tmp_path / "new", "--run.checkpoint-url",
                  "s3://no-such-bucket/run"]):  # a new machine: the URL read for the config
        line = fails(args, s3.env())
        assert re.fullmatch(rf"ddpgpt: error: listing s3://no-such-bucket/run: the bucket "
                            rf"no-such-bucket does not exist at {ENDPOINT}; .*", line), line
    assert not (tmp_path / "run").exists() and not (tmp_path / "new").exists()


def test_a_dataset_prefix_without_meta_json(s3, s3_data, tmp_path):
    line = fails(train(s3_data + "-half", tmp_path), s3.env())
    assert line == (f"ddpgpt: error: dataset {s3_data}-half does not exist; create it with: "
                    f"ddpgpt prepare --out {s3_data}-half")


def test_no_credentials_and_wrong_ones(guarded, tmp_path):
    server, url = guarded
    env = {**server.env(), "AWS_ACCESS_KEY_ID": "", "AWS_SECRET_ACCESS_KEY": ""}
    line = fails(train(f"{url}/tiny", tmp_path), env)
    assert line == (f"ddpgpt: error: listing {url}/tiny: no credentials for the S3 endpoint "
                    f"{server.endpoint} (Unable to locate credentials); set AWS_ACCESS_KEY_ID and "
                    "AWS_SECRET_ACCESS_KEY (or ~/.aws/credentials)"), line
    wrong = server.env({"AccessKeyId": "AKIAWRONGWRONGWRONG", "SecretAccessKey": "nope"})
    line = fails(train(f"{url}/tiny", tmp_path), wrong)
    assert line.startswith(f"ddpgpt: error: listing {url}/tiny: access denied by the S3 "
                           f"endpoint {server.endpoint} (") and \
        line.endswith(f"{CREDENTIALS} read there"), line


def test_wrong_credentials_for_the_checkpoints_an_upload_and_a_runs_url(
        guarded, tiny_data, tmp_path, monkeypatch, capsys):
    """Keys the server does not know: a checkpoint URL, prepare --out URL and the commands
    that read a run's URL each say so in one line naming the URL, before anything is made.
    In this process (cli.main), with s3fs's cached clients dropped around it."""
    import s3fs

    server, url = guarded
    wrong = server.env({"AccessKeyId": "AKIAWRONGWRONGWRONG", "SecretAccessKey": "nope"})
    for key, value in wrong.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("DDPGPT_CACHE_DIR", str(tmp_path / "cache"))
    cases = [(f"{url}/run", train(tiny_data, tmp_path, "--run.checkpoint-url", f"{url}/run")),
             (f"{url}/new", ["prepare", str(tiny_data / "meta.json"), "--out", f"{url}/new"]),
             (f"{url}/run", ["eval", "--run-dir", f"{url}/run", "--device", "cpu"]),
             (f"{url}/run", ["plot", f"{url}/run", "--out", str(tmp_path / "p.png")])]
    s3fs.S3FileSystem.clear_instance_cache()
    try:
        for where, args in cases:
            capsys.readouterr()
            with pytest.raises(SystemExit) as e:
                cli.main([str(a) for a in args])
            err = capsys.readouterr().err
            assert e.value.code == 2 and err.count("\n") == 1, err
            assert err.startswith(f"ddpgpt: error: listing {where}: access denied by the S3 "
                                  f"endpoint {server.endpoint} (") and \
                err.endswith(f"{CREDENTIALS} read there\n"), err
    finally:
        s3fs.S3FileSystem.clear_instance_cache()
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no run dir, no staging


def test_a_wrong_endpoint(s3_data, s3, tmp_path):
    env = {**s3.env(), "AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}",
           "AWS_MAX_ATTEMPTS": "1"}
    line = fails(train(s3_data, tmp_path), env)
    assert re.fullmatch(rf"ddpgpt: error: listing {s3_data}: cannot reach "
                        rf"{ENDPOINT} \(.*\); check AWS_ENDPOINT_URL and that the server is up",
                        line), line


def test_no_permission_to_write_the_checkpoints(guarded, tmp_path):
    """The reader may read the dataset but not write checkpoints: refused before training, and
    nothing written."""
    server, url = guarded
    line = fails(train(f"{url}/tiny", tmp_path, "--run.checkpoint-url", f"{url}/run"),
                 server.env(server.reader), code=1)
    assert re.fullmatch(rf"ddpgpt: error: writing {url}/run/\.probe-[^:]+: access denied by "
                        rf"{ENDPOINT} \(Access Denied\): {re.escape(CREDENTIALS)} write there",
                        line), line
    assert not server.fs(server.writer).exists(f"{url[5:]}/run")


@pytest.mark.parametrize("url, why", [
    ("s4://ckpt/run", r"s4:// is not object storage ddpgpt knows \(s3://, s3a://, gs://, gcs://\); "
                      r"give s3://BUCKET/PREFIX \(or gs://BUCKET/PREFIX\)"),
    ("ckpt/run", r"not a URL of object storage; give s3://BUCKET/PREFIX \(or gs://BUCKET/PREFIX\), "
                 r"or leave it out to keep the checkpoints in the run dir \(--run-dir\)"),
    ("s3:///run", r"no bucket; give s3://BUCKET/PREFIX \(or gs://BUCKET/PREFIX\)")])
def test_a_checkpoint_url_that_is_not_one(s3, s3_data, tmp_path, url, why):
    """A typo'd scheme, a local path or no bucket: one line before anything is made, also on a
    new machine (no --data: the URL would be read for the run's config)."""
    for args in (train(s3_data, tmp_path, "--run.checkpoint-url", url),
                 ["train", "--run-dir", tmp_path / "new", "--run.checkpoint-url", url]):
        line = fails(args, s3.env())
        assert re.fullmatch(rf"ddpgpt: error: --run\.checkpoint-url {re.escape(url)}: {why}",
                            line), line
    assert not (tmp_path / "run").exists() and not (tmp_path / "new").exists()


def test_a_typo_in_the_flag_is_the_usual_did_you_mean(s3, s3_data, tmp_path):
    line = fails(train(s3_data, tmp_path, "--run.checkpoint-urll", "s3://ckpt/run"), s3.env())
    assert line == ("ddpgpt: error: unrecognized arguments: --run.checkpoint-urll s3://ckpt/run "
                    "(did you mean --run.checkpoint-url?)"), line


# ---- the server gone mid-run -------------------------------------------------------------------

GONE = (r"cannot reach the S3 endpoint http://127\.0\.0\.1:\d+ \(.*\); check AWS_ENDPOINT_URL "
        r"and that the server is up\. The last complete checkpoint \(step 2\) is intact: wait "
        r"until the storage answers, then run the same command to resume")


@pytest.mark.parametrize("nproc, data", [(2, "local"), (1, "s3")])
def test_the_server_gone_between_checkpoints_names_the_step_and_the_checkpoint(
        s3, s3_data, tiny_data, tmp_path, nproc, data):
    """The relay to the server is cut after step 2's checkpoint is published: at W=2 what
    meets it first is the lease's renewal before step 4's checkpoint (rank 0); at W=1 with the
    dataset in S3 too, the cut comes with a fetch ahead of later steps' windows (in the
    background, where a failure is read again in the front), and what meets it first in the
    front is a read of step 3's or 4's windows if their fetch ahead was still under way, else
    the lease's renewal at step 4. Either way one line names what the run was doing, why, and
    the intact checkpoint to go on from; exit 1 (not bad input)."""
    url = s3.bucket("gone") + "/run"
    cut = Cut(s3, after=b"step_0000002/meta.json", when=b"lease.json" if nproc > 1 else b".bin")
    source = tiny_data if data == "local" else s3_data
    args = train(source, tmp_path, "--run.checkpoint-url", url, "--run.checkpoint-every", "2",
                 "--no-run.checkpoint-async", *(["--nproc", "2"] if nproc > 1 else []), steps=8)
    out = run_in_process(*args, env={"AWS_ENDPOINT_URL": cut.endpoint, "AWS_MAX_ATTEMPTS": "2"})
    assert cut.severed.is_set() and out.returncode == 1, out.stderr
    said = [line for line in out.stderr.splitlines()
            if line.startswith("ddpgpt:") and not line.startswith("ddpgpt: training on")]
    assert len(said) == 1 and "Traceback" not in out.stderr, out.stderr
    lease = rf"the checkpoint of step 4: reading {url}/lease\.json"
    during = lease if nproc > 1 else rf"(step [34]: reading {s3_data}/train_000000\.bin|{lease})"
    assert re.fullmatch(rf"ddpgpt: error: {during}: {GONE}", said[0]), said[0]
    assert not s3.fs().exists(f"{url[5:]}/step_0000004")

"""The real command line with transformers as the oracle, from GPT-2's side: --init-from a
transformers GPT-2 (GPT-2's vocabulary) at W=2, W&B (offline) mirroring metrics.jsonl across a
resume, the export of a GPT-2 run converting tiktoken's encoding, and every bad input of
--init-from, export and the trackers as one line.

The GPT-2-vocabulary run, started from a random GPT2LMHeadModel on two processes, is this
module's; the bad inputs use the bpe run of tests/e2e/test_hf_export.py too (tests/e2e/conftest.py).
"""

from __future__ import annotations

import importlib.util
import json
import struct
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from ddpgpt import cli
from ddpgpt.data.shards import TokenDataset
from ddpgpt.data.tokenizer import EOT_TEXT
from tests.e2e.hf_runs import DOCS, SMALL, STDLIB, _model, _ok
from tests.helpers import read_metrics, reference_step, write_dataset
from tests.processes import run_cli

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


# ---- GPT-2's vocabulary, --init-from a transformers directory, two processes, W&B -----------

def _wandb_records(path: Path):
    """The records of a W&B offline run file: LevelDB's log format (32 KiB blocks of records
    with a 7-byte header) after W&B's own 7-byte header, each a protobuf Record."""
    from wandb.proto import wandb_internal_pb2

    data, pos, pending = path.read_bytes(), 7, b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        room = 32768 - pos % 32768
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if room < 7 or (length == 0 and kind == 0):
            pos += room
            continue
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST
            yield wandb_internal_pb2.Record.FromString(pending)
            pending = b""


@pytest.fixture(scope="module")
def gpt2_run(tmp_path_factory):
    """A random GPT2LMHeadModel (GPT-2's 50,257 ids, non-zero biases) saved with save_pretrained;
    data of GPT-2 ids made without GPT-2's tokenizer files; 3 steps at W=2 from those weights,
    then a resume to 4, logged to W&B offline."""
    root = tmp_path_factory.mktemp("gpt2")
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_head=2, n_embd=32, n_positions=64, vocab_size=50257)).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1)
    hf.save_pretrained(str(root / "hf"))
    rng = np.random.default_rng(0)
    data = write_dataset(root / "data", rng.integers(0, 50257, 20_000), rng.integers(0, 50257, 800),
                         50257, eot_id=50256, kind="gpt2")
    run = root / "run"
    args = ["train", "--nproc", "2", "--data", data, "--run-dir", run, "--init-from", root / "hf",
            "--data.seq-len", "32", *SMALL, "--run.eval-every", "0", "--run.checkpoint-every", "3",
            "--run.tracker", "wandb"]
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    first = _ok(run_cli(*args, "--run.steps", "3", timeout=240, env=env))
    resumed = _ok(run_cli(*args[:1], *args[3:], "--run.steps", "4", timeout=240, env=env))  # W=1
    return SimpleNamespace(root=root, hf=hf, data=data, run=run, first=first, resumed=resumed)


def test_init_from_transformers_trains_at_w2_from_those_weights(gpt2_run):
    """Step 1's loss, all-reduced over two ranks, is transformers' loss on step 0's batch."""
    rows, evals = read_metrics(gpt2_run.run)
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and all(np.isfinite(r["loss"]) for r in rows)
    stream = np.concatenate(TokenDataset(gpt2_run.data).tokens("train")).astype(np.int64)
    batch = torch.from_numpy(reference_step(stream, 1337, 32, 8, 0))
    with torch.no_grad():
        logits = gpt2_run.hf(batch[:, :-1]).logits
        want = torch.nn.functional.cross_entropy(logits.reshape(-1, 50257),
                                                 batch[:, 1:].reshape(-1))
    assert rows[0]["loss"] == pytest.approx(want.item(), abs=1e-5)
    # The restart continued from its checkpoint, not from the --init-from weights again.
    assert "(step 3, saved at world size 2)" in gpt2_run.resumed.stderr
    config = json.loads((gpt2_run.run / "config.json").read_text())["model"]
    assert (config["vocab_size"], config["vocab_limit"], config["n_embd"]) == (50304, 50257, 32)
    # An older dataset (no byte counts): advice, no crash, no val_bpb.
    assert "has no byte counts in meta.json" in gpt2_run.first.stderr
    assert evals and not any("val_bpb" in e for e in evals)


def test_wandb_offline_run_holds_the_metrics_and_the_resume_appends(gpt2_run):
    rows, evals = read_metrics(gpt2_run.run)
    run_id = json.loads((gpt2_run.run / "tracker.json").read_text())["wandb_id"]
    files = sorted((gpt2_run.run / "wandb").glob("offline-run-*/run-*.wandb"))
    assert [f.name for f in files] == [f"run-{run_id}.wandb"] * 2  # one W&B run, two starts
    logged, configs = {}, []
    for f in files:
        for record in _wandb_records(f):
            kind = record.WhichOneof("record_type")
            if kind == "history":
                row = {i.key or "/".join(i.nested_key): json.loads(i.value_json)
                       for i in record.history.item}
                logged.setdefault(row["step"], {}).update(row)
            elif kind == "run":
                configs.append({i.key or "/".join(i.nested_key): json.loads(i.value_json)
                                for i in record.run.config.update})
    for r in rows:
        assert logged[r["step"]]["loss"] == pytest.approx(r["loss"], rel=1e-9)
        assert logged[r["step"]]["lr"] == pytest.approx(r["lr"], rel=1e-9)
    for e in evals:
        assert logged[e["step"]]["val_loss"] == pytest.approx(e["val_loss"], rel=1e-9)
    assert configs and configs[0]["model.init_from"].endswith("hf")


def test_export_of_a_gpt2_run_converts_tiktokens_encoding(gpt2_run, tmp_path, monkeypatch,
                                                          capsys):
    """GPT-2's own files cannot be downloaded here: tiktoken's encoding is replaced by a small one
    trained here, and the export must give its ids; without either source, one line."""
    tiktoken = pytest.importorskip("tiktoken")
    from tiktoken._educational import bpe_train

    pattern = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
    text = (STDLIB / DOCS[1]).read_text()
    ranks = bpe_train(text[:10_000], 300, pattern)
    enc = tiktoken.Encoding("small", pat_str=pattern, mergeable_ranks=ranks,
                            special_tokens={EOT_TEXT: 300})
    monkeypatch.setattr(tiktoken, "get_encoding", lambda name: enc)
    cli.main(["export", "--run-dir", str(gpt2_run.run), "--out", str(tmp_path / "g")])
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "g"))
    assert tokenizer.encode(text[10_000:12_000]) == enc.encode_ordinary(text[10_000:12_000])
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "g")).eval()
    ids = torch.randint(0, 50257, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(_model(gpt2_run.run)[0](ids)[0][..., :50257],
                                   model(ids).logits, rtol=0, atol=1e-5)

    def offline(*args, **kwargs):
        raise OSError("offline")
    monkeypatch.setattr(tiktoken, "get_encoding", offline)
    monkeypatch.setattr("huggingface_hub.hf_hub_download", offline)
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        cli.main(["export", "--run-dir", str(gpt2_run.run), "--out", str(tmp_path / "h")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1
    assert err.startswith("ddpgpt: error: cannot get GPT-2's tokenizer: tiktoken's gpt2 encoding "
                          "is not cached and openai-community/gpt2 cannot be downloaded")
    assert not (tmp_path / "h").exists() and not list(tmp_path.glob(".h.partial-*"))


# ---- bad input: one line, exit 2 -------------------------------------------------------------

def _fails(capsys, *argv) -> str:
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        cli.main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1, err
    return err.removeprefix("ddpgpt: error: ").rstrip("\n")


def test_bad_input_is_one_line(bpe, gpt2_run, tmp_path, capsys, monkeypatch):
    hf, run = gpt2_run.root / "hf", bpe.run
    train = ["train", "--run-dir", tmp_path / "r", "--device", "cpu"]
    # The dataset's tokenizer is not the weights' (both ways), a shape that disagrees.
    assert _fails(capsys, *train, "--data", bpe.data, "--init-from", hf).startswith(
        f"--init-from {hf}: the weights' tokenizer (gpt2; no tokenizer files beside the weights; "
        f"their 50,257 ids taken for GPT-2's) is not the one of data.dir = {bpe.data} (bpe ")
    assert _fails(capsys, *train, "--data", gpt2_run.data, "--init-from", bpe.out).startswith(
        f"--init-from {bpe.out}: the weights' tokenizer (bpe ")
    assert _fails(capsys, *train, "--data", gpt2_run.data, "--init-from", hf,
                  "--model.n-head", "4") == (
        f"--init-from {hf}: model.n_head = 4 (command line) but the weights have 2; leave the "
        "shape out, it comes from the weights")
    assert "not one of gpt2, gpt2-medium" in _fails(capsys, *train, "--data", gpt2_run.data,
                                                    "--init-from", tmp_path / "nothing")
    # Export: no checkpoint, no such step, --out a file, transformers missing.
    (tmp_path / "empty").mkdir()
    assert _fails(capsys, "export", "--run-dir", tmp_path / "empty", "--out", tmp_path / "o") == (
        f"run {tmp_path / 'empty'} has no complete checkpoint; train first (ddpgpt train "
        f"--run-dir {tmp_path / 'empty'})")
    assert _fails(capsys, "export", "--run-dir", run, "--step", "5", "--out", tmp_path / "o") == (
        f"run {run} has no checkpoint at step 5 (it has: 2, 4, 6); give one of those, or leave "
        "--step out for the newest")
    (tmp_path / "file").write_text("x")
    assert _fails(capsys, "export", "--run-dir", run, "--out", tmp_path / "file") == (
        f"--out {tmp_path / 'file'} is a file; give a directory")
    assert "exists and is not empty; pass --force" in _fails(capsys, "export", "--run-dir", run,
                                                             "--out", bpe.out)
    monkeypatch.setitem(sys.modules, "transformers", None)
    assert _fails(capsys, "export", "--run-dir", run, "--out", tmp_path / "o") == (
        "ddpgpt export needs transformers: pip install 'ddpgpt[export]'")
    # Trackers whose package is missing.
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("tensorboard", "wandb")
                        else find_spec(name, *a))
    for tracker in ("tensorboard", "wandb"):
        assert _fails(capsys, *train, "--data", bpe.data, "--run.tracker", tracker) == (
            f"run.tracker = {tracker} needs {tracker}: "
            "pip install 'ddpgpt[track]' (or run.tracker = none)")


def test_a_hub_name_without_network_is_one_line(gpt2_run, tmp_path):
    r = run_cli("train", "--data", gpt2_run.data, "--run-dir", tmp_path / "r", "--device", "cpu",
                "--init-from", "gpt2-medium",
                env={"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf-home")})
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith("ddpgpt: error: --init-from gpt2-medium: "
                               "openai-community/gpt2-medium is not in the Hugging Face cache "
                               "and cannot be downloaded")
    assert "pass that directory: --init-from ./gpt2-medium" in r.stderr

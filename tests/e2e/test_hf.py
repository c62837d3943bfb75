"""The real command line with the field's libraries as oracles: --init-from a transformers
GPT-2 at W=2, export to transformers and back, TensorBoard and W&B (offline) mirroring
metrics.jsonl across a resume, and every bad input as one line.

Two runs are shared by the tests of this module: a bpe run on one process (TensorBoard) and a
GPT-2-vocabulary run started from a random GPT2LMHeadModel on two (W&B)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import stat
import struct
import sys
import sysconfig
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from ddpgpt import cli
from ddpgpt.checkpoint import read
from ddpgpt.config.commands import PrepareConfig
from ddpgpt.config.io import build, from_dict
from ddpgpt.data.prepare import main as prepare
from ddpgpt.data.shards import TokenDataset
from ddpgpt.data.tokenizer import EOT_TEXT, load_tokenizer
from ddpgpt.hf.init_from import apply_shape, check_tokenizer, read_state
from ddpgpt.model.gpt import GPT
from tests.helpers import (
    assert_greedy_agrees,
    read_metrics,
    reference_step,
    run_cli,
    write_dataset,
)

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]
STDLIB = Path(sysconfig.get_paths()["stdlib"])
DOCS = ["textwrap.py", "shlex.py", "bisect.py", "heapq.py", "fnmatch.py", "glob.py"]
SMALL = ["--data.micro-batch", "2", "--data.global-batch", "8", "--data.eval-windows", "8",
         "--optim.warmup-steps", "2", "--optim.lr", "1e-2", "--device", "cpu",
         "--run.threads", "1"]
SHAPE = ["--model.n-layer", "2", "--model.n-head", "2", "--model.n-embd", "32",
         "--model.block-size", "32"]


def _ok(r):
    assert r.returncode == 0, r.stderr
    return r


def _model(run: Path) -> tuple[GPT, dict]:
    path, meta, state = read.load_latest(run / "checkpoints")
    model = GPT(from_dict(meta["config"]).model).eval()
    model.load_state_dict(state["model"])
    return model, state["model"]


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    """bpe data; a run of 4 steps (checkpoints 2, 4) whose step-4 checkpoint is then lost, as
    in a crash, and which resumes from step 2 to 6; its export."""
    root = tmp_path_factory.mktemp("bpe")
    data, run, out = root / "data", root / "run", root / "exported"
    prepare.run(PrepareConfig(sources=[str(STDLIB / d) for d in DOCS], out=str(data),
                              vocab_size=300, val_fraction=0.3))
    args = ["train", "--data", data, "--run-dir", run, *SHAPE, *SMALL, "--run.eval-every", "2",
            "--run.checkpoint-every", "2", "--run.tracker", "tensorboard"]
    _ok(run_cli(*args, "--run.steps", "4", timeout=120))
    shutil.rmtree(run / "checkpoints" / "step_0000004")
    resumed = _ok(run_cli(*args, "--run.steps", "6", timeout=120))
    assert "resuming from" in resumed.stderr and "(step 2," in resumed.stderr
    export = _ok(run_cli("export", "--run-dir", run, "--out", out, timeout=120))
    return SimpleNamespace(data=data, run=run, out=out, export=export)


def test_tensorboard_holds_the_metrics_once_each_after_a_resume(bpe):
    """Steps 3 and 4 were logged twice (before the lost checkpoint, and again after resuming
    from step 2); TensorBoard's purge keeps the second, as metrics.jsonl does."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    rows, evals = read_metrics(bpe.run)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6] and all("val_bpb" in e for e in evals)
    events = EventAccumulator(str(bpe.run / "tensorboard"))
    events.Reload()
    for name, source in (("loss", rows), ("lr", rows), ("grad_norm", rows), ("mfu", rows),
                         ("tokens_per_s", rows), ("val_loss", evals), ("val_bpb", evals)):
        got = [(e.step, e.value) for e in events.Scalars(name)]
        assert [s for s, _ in got] == [r["step"] for r in source], name
        np.testing.assert_allclose([v for _, v in got], [r[name] for r in source], rtol=1e-6)
    content = events.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    hparams = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info.hparams
    assert hparams["model.n_layer"].number_value == 2
    assert hparams["run.tracker"].string_value == "tensorboard"


def test_export_loads_in_transformers_with_our_logits_tokens_and_text(bpe):
    ours, _ = _model(bpe.run)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(bpe.out)).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(bpe.out))
    run_tok = load_tokenizer(bpe.run, "bpe")
    assert "(step 6) to" in bpe.export.stdout and model.config.vocab_size == run_tok.vocab_size
    # The tokenizer: the run's ids for the run's own text, and back.
    text = (STDLIB / DOCS[0]).read_text()
    ids = tokenizer.encode(text)
    assert ids == run_tok.encode_batch([text])[0].tolist() and tokenizer.decode(ids) == text
    assert tokenizer.eos_token == EOT_TEXT and tokenizer.eos_token_id == run_tok.eot_id
    # The model: logits (fp32; 1e-5: the same products summed in another order) and greedy text.
    x = torch.tensor([ids[:32], ids[100:132]])
    with torch.no_grad():
        torch.testing.assert_close(ours(x)[0][..., :run_tok.vocab_size], model(x).logits,
                                   rtol=0, atol=1e-5)
        theirs = model.generate(x[:, :8], max_new_tokens=20, do_sample=False,
                                pad_token_id=run_tok.eot_id)
    # greedy by two implementations: the same tokens but at a tie within fp32's rounding
    assert_greedy_agrees(ours.generate(x[:, :8], 20, top_k=1, vocab_size=run_tok.vocab_size),
                         theirs, lambda prefix: ours(prefix)[0][:, -1, :run_tok.vocab_size])


def test_the_exported_files_have_one_mode(bpe):
    """model.safetensors as readable as the files beside it (safetensors creates it 0600): the
    mode open() gives under the umask the test runs with."""
    mask = os.umask(0)
    os.umask(mask)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in bpe.out.iterdir()}
    assert "model.safetensors" in modes and set(modes.values()) == {0o666 & ~mask}, modes


def test_export_then_init_from_gives_the_same_weights(bpe):
    """The export's tokenizer (config.json's ddpgpt entry) is the data's, and --init-from it
    loads the checkpoint's weights exactly; the padding rows come back zero, and masked."""
    cfg = build(None, None, {"model": {"init_from": str(bpe.out)},
                             "data": {"dir": str(bpe.data)}}, shape=apply_shape)
    check_tokenizer(cfg, TokenDataset(bpe.data))
    model = GPT(cfg.model)
    model.load_state_dict(read_state(str(bpe.out), model.cfg))
    _, saved = _model(bpe.run)
    vocab = load_tokenizer(bpe.run, "bpe").vocab_size
    assert cfg.model.vocab_limit == vocab and cfg.model.vocab_size == saved["wte.weight"].size(0)
    for name, t in model.state_dict().items():
        if name == "wte.weight":
            assert torch.equal(t[:vocab], saved[name][:vocab]) and not t[vocab:].any()
        else:
            assert torch.equal(t, saved[name]), name


# ---- the modern arch: sharded, resumed across W and mode, exported, read back, trained on ---

MODERN = ["--model.arch", "modern", "--optim.name", "muon", "--run.checkpoint-every", "2",
          "--run.eval-every", "2", "--optim.decay-steps", "6"]  # the straight run's schedule


@pytest.fixture(scope="module")
def modern(bpe):
    """A modern run (rotary, RMSNorm, QK-norm, SwiGLU, untied head) with Muon: 4 steps under
    fsdp2 at W=2 (sharded checkpoints), resumed at W=1 under zero1 to 6; the same 6 steps
    straight at W=1 under ddp; its export (Qwen3ForCausalLM); 2 steps --init-from the export."""
    root = bpe.run.parent / "modern"
    run, straight, out, tuned = (root / n for n in ("run", "straight", "exported", "tuned"))
    args = ["train", "--data", bpe.data, *SHAPE, *SMALL, *MODERN]
    _ok(run_cli(*args, "--run-dir", run, "--nproc", "2", "--run.sync", "fsdp2", "--run.steps", "4",
                timeout=240))
    resumed = _ok(run_cli(*args, "--run-dir", run, "--run.sync", "zero1", "--run.steps", "6",
                          timeout=120))
    _ok(run_cli(*args, "--run-dir", straight, "--run.steps", "6", timeout=120))
    export = _ok(run_cli("export", "--run-dir", run, "--out", out, timeout=120))
    evaluated = _ok(run_cli("eval", "--run-dir", run, "--device", "cpu", "--json", timeout=120))
    sampled = _ok(run_cli("sample", "--run-dir", run, "--device", "cpu", "--prompt", "def ",
                          "--max-new-tokens", "40", timeout=120))
    trained = _ok(run_cli("train", "--data", bpe.data, "--run-dir", tuned, "--init-from", out,
                          *SMALL, "--run.steps", "2", "--run.eval-every", "0", timeout=120))
    return SimpleNamespace(run=run, straight=straight, out=out, tuned=tuned, resumed=resumed,
                           export=export, evaluated=evaluated, sampled=sampled, trained=trained)


def test_a_modern_run_resumes_across_world_sizes_and_modes(modern):
    """fsdp2 at W=2 -> zero1 at W=1 from its step-4 checkpoint: the straight ddp run's losses
    (the order of float sums apart: 2e-5, as tests/dist/test_resume.py) and every piece in
    config.json."""
    rows, _ = read_metrics(modern.run)
    ref, _ = read_metrics(modern.straight)
    assert "(step 4, saved at world size 2)" in modern.resumed.stderr
    assert [r["step"] for r in rows] == [r["step"] for r in ref] == list(range(1, 7))
    np.testing.assert_allclose([r["loss"] for r in rows], [r["loss"] for r in ref], rtol=2e-5)
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.5  # it learns: the comparison is not of noise
    config = json.loads((modern.run / "config.json").read_text())["model"]
    assert {k: config[k] for k in ("arch", "rope", "norm", "qk_norm", "mlp", "bias",
                                   "tie_embeddings", "zero_init_proj", "mlp_hidden")} == {
        "arch": "modern", "rope": True, "norm": "rmsnorm", "qk_norm": True, "mlp": "swiglu",
        "bias": False, "tie_embeddings": False, "zero_init_proj": True, "mlp_hidden": 96}


def test_a_modern_run_evaluates_samples_and_exports_to_qwen3(modern, bpe):
    ours, _ = _model(modern.run)
    _, evals = read_metrics(modern.run)
    got = json.loads(modern.evaluated.stdout)
    assert got["step"] == 6 and got["val_loss"] == pytest.approx(evals[-1]["val_loss"], abs=1e-5)
    assert got["val_bpb"] == pytest.approx(evals[-1]["val_bpb"], abs=1e-5)
    assert modern.sampled.stdout.startswith("def ")
    assert "Qwen3ForCausalLM" in modern.export.stdout
    model = transformers.AutoModelForCausalLM.from_pretrained(str(modern.out)).eval()
    assert type(model).__name__ == "Qwen3ForCausalLM"
    run_tok = load_tokenizer(modern.run, "bpe")
    ids = transformers.AutoTokenizer.from_pretrained(str(modern.out)).encode(
        (STDLIB / DOCS[0]).read_text())
    assert ids == run_tok.encode_batch([(STDLIB / DOCS[0]).read_text()])[0].tolist()
    x = torch.tensor([ids[:32], ids[100:132]])
    with torch.no_grad():
        logits = ours(x)[0][..., :run_tok.vocab_size]
        torch.testing.assert_close(model(x).logits, logits, rtol=0, atol=1e-5)
        theirs = model.generate(x[:, :8], max_new_tokens=20, do_sample=False,
                                pad_token_id=run_tok.eot_id)
    assert torch.equal(ours.generate(x[:, :8], 20, top_k=1, vocab_size=run_tok.vocab_size),
                       theirs)


def test_init_from_a_modern_export_trains_from_its_weights(modern, bpe):
    """Step 1's loss is transformers' loss on step 0's batch: the export's weights, read back
    through its Qwen3 layout, with the architecture from its config.json."""
    rows, _ = read_metrics(modern.tuned)
    assert [r["step"] for r in rows] == [1, 2] and all(np.isfinite(r["loss"]) for r in rows)
    tuned, _ = _model(modern.tuned)
    start = read_state(str(modern.out), tuned.cfg)
    assert all(not torch.equal(t, start[n]) for n, t in tuned.state_dict().items()
               if n.endswith("qkv.weight"))  # it trained on from there
    model = transformers.AutoModelForCausalLM.from_pretrained(str(modern.out)).eval()
    vocab = model.config.vocab_size
    stream = np.concatenate(TokenDataset(bpe.data).tokens("train")).astype(np.int64)
    batch = torch.from_numpy(reference_step(stream, 1337, 32, 8, 0))
    with torch.no_grad():
        logits = model(batch[:, :-1]).logits
        want = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab),
                                                 batch[:, 1:].reshape(-1))
    assert rows[0]["loss"] == pytest.approx(want.item(), abs=1e-5)
    config = json.loads((modern.tuned / "config.json").read_text())["model"]
    assert (config["arch"], config["qk_norm"], config["n_embd"], config["init_from"]) == (
        "modern", True, 32, str(modern.out))


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

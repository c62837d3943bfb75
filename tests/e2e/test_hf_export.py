"""The real command line with transformers as the oracle, on runs of ours: a bpe run on one
process, TensorBoard mirroring metrics.jsonl across a resume, export to transformers and back
(--init-from the export); the modern arch sharded, resumed across W and mode, exported as Qwen3,
read back and trained on.

The bpe run is shared with tests/e2e/test_hf_gpt2.py (tests/e2e/conftest.py); the modern run is
this module's."""

from __future__ import annotations

import json
import os
import stat
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from ddpgpt.config.io import build
from ddpgpt.data.shards import TokenDataset
from ddpgpt.data.tokenizer import EOT_TEXT, load_tokenizer
from ddpgpt.hf.init_from import apply_shape, check_tokenizer, read_state
from ddpgpt.model.gpt import GPT
from tests.e2e.hf_runs import DOCS, SHAPE, SMALL, STDLIB, _model, _ok
from tests.helpers import assert_greedy_agrees, read_metrics, reference_step
from tests.in_process import run_in_process

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


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
    _ok(run_in_process(*args, "--run-dir", run, "--nproc", "2", "--run.sync", "fsdp2",
                       "--run.steps", "4"))
    resumed = _ok(run_in_process(*args, "--run-dir", run, "--run.sync", "zero1",
                                 "--run.steps", "6"))
    _ok(run_in_process(*args, "--run-dir", straight, "--run.steps", "6"))
    export = _ok(run_in_process("export", "--run-dir", run, "--out", out))
    evaluated = _ok(run_in_process("eval", "--run-dir", run, "--device", "cpu", "--json"))
    sampled = _ok(run_in_process("sample", "--run-dir", run, "--device", "cpu", "--prompt", "def ",
                                 "--max-new-tokens", "40"))
    trained = _ok(run_in_process("train", "--data", bpe.data, "--run-dir", tuned, "--init-from",
                                 out, *SMALL, "--run.steps", "2", "--run.eval-every", "0"))
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

"""--init-from a base run (its run dir or a checkpoint) for a fine-tune on conversations: the
model's shape from the run, the vocabulary grown by the chat template's tokens (the new rows the
mean of the trained ones, said in one line), another tokenizer refused in one line, and a
GPT-2 model's padded rows taken as they are."""

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from ddpgpt.config.io import build
from ddpgpt.config.model import ModelConfig
from ddpgpt.config.schema import TrainConfig
from ddpgpt.errors import UserError
from ddpgpt.model.gpt import GPT
from ddpgpt.run.init_weights import apply_shape, grow_vocab, grown, read_state
from ddpgpt.run.preflight import preflight
from tests.helpers import write_dataset, write_run

BASE = ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=32, vocab_size=257, arch="modern")


@pytest.fixture(scope="module")
def base_run(tmp_path_factory):
    """A run dir as `ddpgpt train` leaves it, of a byte-level base model: its config, its data's
    meta.json, one checkpoint (step 3)."""
    run = tmp_path_factory.mktemp("base") / "run"
    return run, write_run(run, BASE, "byte", 257)


def configure(data, init, tmp_path):
    flags = {"data": {"dir": str(data), "micro_batch": 2, "global_batch": 4},
             "model": {"init_from": str(init)},
             "run": {"dir": str(tmp_path / "sft"), "device": "cpu", "threads": 1}}
    return preflight(build(None, None, flags, shape=apply_shape), 1, 1)


@pytest.mark.parametrize("which", ["run dir", "checkpoint"])
def test_a_fine_tune_from_a_run_grows_its_vocabulary_by_the_template(chat_data, base_run,
                                                                      tmp_path, which):
    run, weights = base_run
    init = run if which == "run dir" else run / "checkpoints" / "step_0000003"
    cfg, dataset = configure(chat_data, init, tmp_path)
    assert (cfg.model.n_embd, cfg.model.arch, cfg.model.vocab_size) == (32, "modern", 263)
    state = read_state(str(init), cfg.model, dataset.vocab_size)
    for name in ("wte.weight", "lm_head.weight"):
        old, new = weights[name], state[name]
        assert new.shape == (263, 32)
        assert torch.equal(new[:257], old)  # every trained row as it was
        torch.testing.assert_close(new[257:], old.mean(0).expand(6, 32), rtol=0, atol=0)
    assert torch.equal(state["blocks.0.attn.qkv.weight"], weights["blocks.0.attn.qkv.weight"])
    GPT(cfg.model).load_state_dict(state)  # the run's model takes it whole
    assert grown(str(init), cfg.model, dataset.vocab_size) == (
        f"ddpgpt: --init-from {init}: the vocabulary grows from 257 to 263 ids (the chat "
        "template's tokens, ids 257-262; the model's rows: 263), their embedding and head rows "
        "starting as the mean of the trained ones")


def test_data_of_another_tokenizer_is_refused_in_one_line(base_run, tmp_path):
    run, _ = base_run
    other = write_dataset(tmp_path / "other", [0] * 400, [0] * 100, 300, kind="gpt2")
    with pytest.raises(UserError) as e:
        configure(other, run, tmp_path)
    assert str(e.value) == (
        f"--init-from {run}: the run's tokenizer (byte) is not the one of data.dir = {other} "
        "(gpt2), nor it with the chat template's tokens added: its ids would mean other text; "
        f"prepare the data with --tokenizer-from {run}")


def test_a_gpt2_models_padded_rows_hold_the_template_tokens():
    cfg = TrainConfig(model=ModelConfig(vocab_size=50304, vocab_limit=50257, arch="gpt2"))
    after = grow_vocab(cfg, SimpleNamespace(vocab_size=50263))
    assert (after.model.vocab_size, after.model.vocab_limit) == (50304, 50263)
    assert grow_vocab(cfg, SimpleNamespace(vocab_size=50257)) is cfg  # nothing to grow
    plain = TrainConfig(model=ModelConfig(vocab_size=4096))
    assert grow_vocab(plain, SimpleNamespace(vocab_size=4102)).model.vocab_size == 4102


@pytest.mark.parametrize("kind", ["byte", "bpe"])
def test_a_fine_tune_from_an_export_grows_its_vocabulary_alike(tmp_path, kind):
    """The base exported (transformers writes its tokenizer anew), conversations prepared with
    --tokenizer-from the export: its tokenizer with the template's tokens after its ids."""
    pytest.importorskip("transformers")
    from ddpgpt.commands import export
    from ddpgpt.config.commands import ExportConfig, PrepareConfig
    from ddpgpt.data.prepare import main as prepare
    from ddpgpt.data.tokenizer import BPETokenizer
    from tests.helpers import write_conversations

    run = tmp_path / "base"
    run.mkdir()
    vocab = 257
    if kind == "bpe":
        BPETokenizer.train(["some text to learn a few merges from " * 30], 300, False).save(run)
        vocab = BPETokenizer.load(run).vocab_size
    weights = write_run(run, dataclasses.replace(BASE, vocab_size=vocab), kind, vocab)
    export.run(ExportConfig(run_dir=str(run), out=str(tmp_path / "exported")))
    prepare.run(PrepareConfig(sources=[str(write_conversations(tmp_path / "c.jsonl", 40))],
                              chat=True, tokenizer_from=str(tmp_path / "exported"),
                              val_fraction=0.2, out=str(tmp_path / "chat"), workers=1))
    cfg, dataset = configure(tmp_path / "chat", tmp_path / "exported", tmp_path)
    assert dataset.vocab_size == vocab + 6 and cfg.model.vocab_size >= vocab + 6
    state = read_state(str(tmp_path / "exported"), cfg.model, dataset.vocab_size)
    for name in ("wte.weight", "lm_head.weight"):
        torch.testing.assert_close(state[name][:vocab], weights[name])
        torch.testing.assert_close(state[name][vocab:vocab + 6],
                                   weights[name].mean(0).expand(6, 32))

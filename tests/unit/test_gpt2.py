"""GPT-2's layout in and out against transformers' own GPT2LMHeadModel, the tokenizers export
writes against ddpgpt's and tiktoken's, and --init-from's rules (shape, tokenizer, bad input)."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch

from ddpgpt.commands.export import byte_tokenizer, from_tiktoken, write_model
from ddpgpt.config import io as config_io
from ddpgpt.config.checks import ConfigError
from ddpgpt.config.model import ModelConfig
from ddpgpt.data.shards import TokenDataset
from ddpgpt.data.tokenizer import EOT_TEXT, ByteTokenizer
from ddpgpt.errors import UserError
from ddpgpt.hf import gpt2
from ddpgpt.hf.init_from import (
    ASSUMED_GPT2,
    apply_shape,
    check_tokenizer,
    read_state,
    weights_tokenizer,
)
from ddpgpt.model.gpt import GPT
from tests.helpers import write_dataset


def build(preset, config_file, flags):
    """`train`'s config: the shape of --model.init-from's weights applied (as the CLI does)."""
    return config_io.build(preset, config_file, flags, shape=apply_shape)

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")
GPT2_PATTERN = (r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|"""
                r"""\s+""")
TEXT = (Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py").read_text()


def hf_gpt2(path: Path, vocab: int = 300, seed: int = 0):
    """A small random GPT2LMHeadModel with non-zero biases (transformers' init zeroes them),
    saved with save_pretrained into `path`."""
    torch.manual_seed(seed)
    config = transformers.GPT2Config(n_layer=2, n_head=4, n_embd=32, n_positions=48,
                                     vocab_size=vocab, bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1)
    model.save_pretrained(str(path))
    return model


def ours(spec: str, **model_flags) -> GPT:
    cfg = build(None, None, {"model": {"init_from": spec, **model_flags}})
    model = GPT(cfg.model).eval()
    model.load_state_dict(read_state(spec, model.cfg))
    return model


@pytest.mark.parametrize("vocab, rows", [(6350, 6400), (300, 300)])
def test_import_gives_transformers_logits(tmp_path, vocab, rows):
    """Same ids, same logits (fp32, 1e-5: both sum the same products in another order), and the
    padding rows (a dataset's rule: 6,350 ids -> 6,400 rows; 300 stay 300) are -inf."""
    theirs = hf_gpt2(tmp_path / "hf", vocab=vocab)
    model = ours(str(tmp_path / "hf"))
    assert (model.cfg.n_layer, model.cfg.n_head, model.cfg.n_embd, model.cfg.block_size,
            model.cfg.vocab_size, model.cfg.vocab_limit) == (2, 4, 32, 48, rows, vocab)
    idx = torch.randint(0, vocab, (3, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(idx)[0]
        torch.testing.assert_close(logits[..., :vocab], theirs(idx).logits, rtol=0, atol=1e-5)
    assert logits.size(-1) == rows and torch.isinf(logits[..., vocab:]).all()


def test_a_bare_safetensors_file_needs_the_heads(tmp_path):
    """A .safetensors file alone: the shape from its tensors, the heads from --model.n-head."""
    theirs = hf_gpt2(tmp_path / "hf")
    lone = tmp_path / "lone" / "weights.safetensors"
    lone.parent.mkdir()
    lone.write_bytes((tmp_path / "hf" / "model.safetensors").read_bytes())
    with pytest.raises(UserError, match="give --model.n-head"):
        ours(str(lone))
    idx = torch.randint(0, 300, (1, 10), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(ours(str(lone), n_head="4")(idx)[0][..., :300],
                                   theirs(idx).logits, rtol=0, atol=1e-5)


def test_exact_gelu_goes_out_and_back_as_transformers_gelu(tmp_path):
    """model.gelu exact is transformers' activation "gelu": the export says so, transformers
    computes our logits from it, and --init-from reads it back; tanh's logits are others."""
    cfg = ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=300,
                      gelu="exact", arch="gpt2")
    model = GPT(cfg, seed=3).eval()
    with torch.no_grad():  # large pre-activations and logits, where the two GELUs part
        model.wte.weight *= 100
        for block in model.blocks:
            block.mlp.fc.weight *= 100
            block.mlp.proj.weight *= 100
    write_model(tmp_path / "out", model.state_dict(), cfg, 300, 0, "none")
    assert json.loads((tmp_path / "out" / "config.json").read_text())[
        "activation_function"] == "gelu"
    theirs = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "out")).eval()
    back = ours(str(tmp_path / "out"))
    assert back.cfg.gelu == "exact"
    idx = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        logits = model(idx)[0]
        torch.testing.assert_close(theirs(idx).logits, logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(back(idx)[0][..., :300], logits, rtol=1e-5, atol=1e-5)
        tanh = GPT(ModelConfig(**{**vars(cfg), "gelu": "tanh"})).eval()
        tanh.load_state_dict(model.state_dict())
        assert (tanh(idx)[0] - logits).abs().max() > 1e-3


def test_export_layout_round_trips_and_zero_biases_are_no_biases(tmp_path):
    """ours -> GPT-2 -> ours is the identity; a model without biases is exported with zero biases
    and transformers computes the same logits from them."""
    for bias in (True, False):
        cfg = ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=320,
                          bias=bias, arch="gpt2")
        model = GPT(cfg, seed=3).eval()
        exported = gpt2.to_gpt2(model.state_dict(), 300, bias)
        back = gpt2.from_gpt2(gpt2.strip_prefix(exported), 320, bias)
        for name, t in model.state_dict().items():
            want = torch.cat([t[:300], torch.zeros(20, 32)]) if name == "wte.weight" else t
            assert torch.equal(back[name], want), name
        out = tmp_path / f"bias-{bias}"
        out.mkdir()
        write_model(out, model.state_dict(), cfg, 300, 0, "byte")
        theirs = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
        idx = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(4))
        with torch.no_grad():
            torch.testing.assert_close(model(idx)[0][..., :300], theirs(idx).logits, rtol=0,
                                       atol=1e-5)
        assert json.loads((out / "config.json").read_text())["ddpgpt"] == {"tokenizer": "byte",
                                                                          "bias": bias}
    with pytest.raises(UserError, match="non-zero biases"):
        gpt2.from_gpt2(gpt2.strip_prefix(gpt2.to_gpt2(GPT(ModelConfig(
            n_layer=1, n_head=2, n_embd=32, block_size=16, vocab_size=64,
            arch="gpt2")).state_dict(), 64, True)
            | {"transformer.ln_f.bias": torch.ones(32)}), 64, bias=False)


def test_byte_tokenizer_export_is_ddpgpts_byte_tokenizer():
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=byte_tokenizer(),
                                              eos_token=EOT_TEXT)
    text = TEXT[:2000] + "caf\xe9 \u2713 \U0001f600 \t\r\n  end"
    ids = hf.encode(text)
    assert ids == ByteTokenizer().encode_batch([text])[0].tolist()
    assert hf.decode(ids) == text
    assert hf.eos_token_id == 256 and hf.encode(EOT_TEXT) == [256]


def test_tiktoken_conversion_gives_tiktokens_ids():
    """The gpt2 export path converts tiktoken's encoding; the oracle is tiktoken itself, on an
    encoding trained here (GPT-2's own files cannot be downloaded)."""
    tiktoken = pytest.importorskip("tiktoken")
    from tiktoken._educational import bpe_train

    ranks = bpe_train(TEXT[:20000], 320, GPT2_PATTERN)
    enc = tiktoken.Encoding("small", pat_str=GPT2_PATTERN, mergeable_ranks=ranks,
                            special_tokens={EOT_TEXT: len(ranks)})
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=from_tiktoken(enc))
    for text in (TEXT[20000:26000], "  x = {'a': 1}\n\n\tdef f():  return 'é' \u2713"):
        assert hf.encode(text) == enc.encode_ordinary(text)
        assert hf.decode(hf.encode(text)) == text
    assert hf.convert_tokens_to_ids(EOT_TEXT) == len(ranks)


# ---- --init-from's rules ---------------------------------------------------------------------

def test_a_shape_set_explicitly_must_match_the_weights(tmp_path):
    hf_gpt2(tmp_path / "hf")
    spec = str(tmp_path / "hf")
    with pytest.raises(ConfigError) as e:
        build(None, None, {"model": {"init_from": spec, "n_layer": "3", "block_size": "32"}})
    assert str(e.value) == (f"--init-from {spec}: model.n_layer = 3 (command line) but the weights "
                            "have 2; model.block_size = 32 (command line) but the weights have "
                            "48; leave the shape out, it comes from the weights (train on "
                            "shorter sequences with --data.seq-len)")
    toml = tmp_path / "run.toml"
    toml.write_text("[model]\nn_embd = 64\n")
    with pytest.raises(ConfigError, match=rf"model.n_embd = 64 \({toml}\) but the weights have 32"):
        build(None, str(toml), {"model": {"init_from": spec}})
    # A preset's shape gives way; what agrees, and a wider padded vocabulary, are kept.
    cfg = build("tiny", None, {"model": {"init_from": spec, "n_layer": "2", "vocab_size": "384"}})
    assert (cfg.model.n_layer, cfg.model.n_embd, cfg.model.vocab_size) == (2, 32, 384)
    assert cfg.optim.lr == build("tiny", None, {}).optim.lr


def test_refuses_variants_and_ddpgpt_checkpoints(tmp_path):
    hf_gpt2(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config,
                                                             "activation_function": "relu"}))
    with pytest.raises(UserError, match="activation_function 'relu' .only gelu_new or gelu."):
        build(None, None, {"model": {"init_from": str(tmp_path / "hf")}})
    from safetensors.torch import save_file
    save_file(GPT(ModelConfig(vocab_size=64)).state_dict(), str(tmp_path / "ours.safetensors"))
    with pytest.raises(UserError, match="a ddpgpt checkpoint's weights; continue that run"):
        build(None, None, {"model": {"init_from": str(tmp_path / "ours.safetensors")}})


def test_the_datasets_tokenizer_must_be_the_weights(tmp_path, capsys):
    ids = np.arange(200) % 256
    byte_data = write_dataset(tmp_path / "byte", ids, ids, 257)
    gpt2_data = write_dataset(tmp_path / "g", ids, ids, 50257, eot_id=50256, kind="gpt2")
    hf_gpt2(tmp_path / "hf300")
    hf_gpt2(tmp_path / "hf50257", vocab=50257)
    # No tokenizer files: GPT-2's when the vocabulary is GPT-2's (said, as a warning) ...
    assert weights_tokenizer(str(tmp_path / "hf50257")) == ("gpt2", ASSUMED_GPT2)
    cfg = build(None, None, {"model": {"init_from": str(tmp_path / "hf50257")},
                             "data": {"dir": str(gpt2_data)}})
    check_tokenizer(cfg, TokenDataset(gpt2_data))
    assert "their 50,257 ids taken for GPT-2's" in capsys.readouterr().err
    with pytest.raises(UserError, match=r"the weights' tokenizer \(gpt2; no tokenizer files "
                                        r"beside the weights; .*\) is not the one of "
                                        r"data.dir = .* \(byte\)"):
        check_tokenizer(cfg, TokenDataset(byte_data))
    # ... else nothing says what the ids mean.
    cfg = build(None, None, {"model": {"init_from": str(tmp_path / "hf300")}})
    with pytest.raises(UserError, match="no tokenizer beside the weights"):
        check_tokenizer(cfg, TokenDataset(byte_data))
    # config.json's ddpgpt entry (written by export) names it.
    config = json.loads((tmp_path / "hf300" / "config.json").read_text())
    (tmp_path / "hf300" / "config.json").write_text(json.dumps({**config,
                                                                "ddpgpt": {"tokenizer": "byte"}}))
    check_tokenizer(cfg, TokenDataset(byte_data))
    cfg = build(None, None, {"model": {"init_from": "gpt2"}})
    with pytest.raises(UserError, match="prepare the data with --tokenizer gpt2"):
        check_tokenizer(cfg, TokenDataset(byte_data))

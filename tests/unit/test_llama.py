"""The modern arch in and out of transformers, against its own Qwen3ForCausalLM,
LlamaForCausalLM and ApertusForCausalLM: export gives their logits, --init-from a small random
model of each family (grouped-query heads, wide heads, tied or untied head, biases, ReLU²) gives
its logits, and what no class computes is refused in one line naming the setting."""

from __future__ import annotations

import dataclasses
import importlib
import json

import pytest
import torch

from ddpgpt.commands.export import layout, write_model
from ddpgpt.config import io as config_io
from ddpgpt.config.checks import ConfigError
from ddpgpt.config.model import ModelConfig
from ddpgpt.errors import UserError
from ddpgpt.hf import llama
from ddpgpt.hf.init_from import apply_shape, read_state
from ddpgpt.model.gpt import GPT

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")
MODERN = ModelConfig(n_layer=2, n_head=4, n_embd=32, block_size=24, vocab_size=320,
                     arch="modern")


def build(flags: dict):
    return config_io.build(None, None, {"model": flags}, shape=apply_shape)


def hf_model(path, kind: str = "qwen3", vocab: int = 300, seed: int = 0, **fields):
    """A small random transformers model of `kind`, its norms' gains and biases random too
    (transformers' init sets them to 1 and 0, where a wrong mapping would go unseen), saved into
    `path`."""
    torch.manual_seed(seed)
    make = getattr(transformers, llama.CONFIGS[kind])
    defaults = dict(vocab_size=vocab, hidden_size=32, intermediate_size=72, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    max_position_embeddings=24, rms_norm_eps=1e-6, bos_token_id=0,
                    eos_token_id=0, rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    model = transformers.AutoModelForCausalLM.from_config(make(**{**defaults, **fields})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(torch.randn_like(p) * 0.3 + (0.0 if name.endswith("bias") else 1.0))
            else:
                p.normal_(0, 0.2)
    model.save_pretrained(str(path))
    return model


def ours(spec: str, **flags) -> GPT:
    cfg = build({"init_from": spec, **flags})
    model = GPT(cfg.model).eval()
    model.load_state_dict(read_state(spec, model.cfg))
    return model


def _ids(vocab: int, T: int = 24, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (3, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kind, fields", [
    ("qwen3", {}),                                                   # QK-norm, untied, GQA
    ("qwen3", {"tie_word_embeddings": True, "head_dim": 24,          # Qwen3-0.6B's shape: tied,
               "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}),  # wide heads
    ("llama", {"attention_bias": True, "mlp_bias": True, "num_key_value_heads": 1,
               "rms_norm_eps": 1e-5}),                               # biases, one kv head
    ("apertus", {"hidden_act": "relu2"}),                            # QK-norm, ReLU²
    ("apertus", {"hidden_act": "gelu_pytorch_tanh", "tie_word_embeddings": True}),
])
@pytest.mark.parametrize("vocab, rows", [(6350, 6400), (300, 300)])
def test_init_from_a_transformers_model_gives_its_logits(tmp_path, kind, fields, vocab, rows):
    """Same ids, same logits (fp32, 1e-5), the shape and every piece from config.json, and the
    padding rows (6,350 ids -> 6,400) at -inf."""
    theirs = hf_model(tmp_path / "hf", kind, vocab, **fields)
    model = ours(str(tmp_path / "hf"))
    cfg, hf = model.cfg, theirs.config
    mlp = {"relu2": "relu2", "gelu_pytorch_tanh": "gelu"}.get(hf.hidden_act, "swiglu")
    assert (cfg.arch, cfg.rope, cfg.norm, cfg.mlp, cfg.qk_norm) == (
        "modern", True, "rmsnorm", mlp, kind != "llama")
    assert mlp != "gelu" or cfg.gelu == "tanh"
    assert (cfg.n_layer, cfg.n_head, cfg.n_kv_head, cfg.head_dim, cfg.mlp_hidden, cfg.block_size,
            cfg.tie_embeddings, cfg.bias, cfg.norm_eps, cfg.rope_theta) == (
        2, 4, hf.num_key_value_heads, hf.head_dim, 72, 24, hf.tie_word_embeddings,
        hf.attention_bias, hf.rms_norm_eps, hf.rope_parameters["rope_theta"])
    assert (cfg.vocab_size, cfg.vocab_limit) == (rows, vocab)
    idx = _ids(vocab)
    with torch.no_grad():
        logits = model(idx)[0]
        torch.testing.assert_close(logits[..., :vocab], theirs(idx).logits, rtol=0, atol=1e-5)
    assert logits.abs()[..., :vocab].max() > 1  # logits worth comparing
    assert torch.isinf(logits[..., vocab:]).all()


@pytest.mark.parametrize("fields, family", [
    ({}, "Qwen3ForCausalLM"),
    ({"qk_norm": False, "bias": True, "n_kv_head": 2}, "LlamaForCausalLM"),
    ({"tie_embeddings": True, "head_dim": 12, "n_kv_head": 1, "rope_theta": 500.0,
      "norm_eps": 1e-6, "zero_init_proj": False}, "Qwen3ForCausalLM"),
    ({"mlp": "relu2", "n_kv_head": 2}, "ApertusForCausalLM"),
    ({"mlp": "gelu", "gelu": "exact", "tie_embeddings": True}, "ApertusForCausalLM"),
])
def test_export_is_read_by_transformers_with_our_logits_and_read_back(tmp_path, fields, family):
    """ours -> transformers: its class computes our logits (the padding rows cut); transformers'
    directory -> ours: the same weights."""
    cfg = dataclasses.replace(MODERN, **fields)
    model = GPT(cfg, seed=3).eval()
    with torch.no_grad():  # away from init: zero projections, unit gains would hide a mix-up
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * (0.3 if p.dim() == 1 else 0.15)
                    + (1.0 if p.dim() == 1 else 0.0))
    assert layout(cfg) == family
    assert write_model(tmp_path, model.state_dict(), cfg, 300, 0, "byte") == family
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["architectures"] == [family] and written["ddpgpt"] == {"tokenizer": "byte"}
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    assert type(theirs).__name__ == family
    idx = _ids(300)
    with torch.no_grad():
        logits = model(idx)[0][..., :300]
        torch.testing.assert_close(theirs(idx).logits, logits, rtol=0, atol=1e-5)
        assert logits.abs().max() > 1
        back = ours(str(tmp_path))
        torch.testing.assert_close(back(idx)[0][..., :300], logits, rtol=0, atol=1e-5)
    for name, t in model.state_dict().items():
        want = t[:300] if name in ("wte.weight", "lm_head.weight") else t
        assert torch.equal(back.state_dict()[name][:want.size(0)], want), name


def test_layout_round_trips():
    """ours -> theirs -> ours is the identity, padding rows back as zeros."""
    cfg = dataclasses.replace(MODERN, n_kv_head=2, bias=True, qk_norm=False).resolved()
    state = GPT(cfg, seed=1).state_dict()
    back = llama.from_llama(llama.to_llama(state, cfg, 300), cfg)
    assert back.keys() == state.keys()
    for name, t in state.items():
        want = torch.cat([t[:300], torch.zeros(20, 32)]) if name.endswith(
            ("wte.weight", "lm_head.weight")) else t
        assert torch.equal(back[name], want), name


@pytest.mark.parametrize("fields, message", [
    ({"mlp": "relu2", "qk_norm": False},
     "model.mlp = relu2 without model.qk_norm: ApertusForCausalLM, the transformers class for an "
     "ungated MLP with rotary positions, has QK-norm; train with model.qk_norm true (or model.mlp "
     "swiglu: LlamaForCausalLM) to export"),
    ({"mlp": "gelu", "bias": True},
     "model.bias = true with model.mlp = gelu: ApertusForCausalLM, the transformers class for an "
     "ungated MLP with rotary positions, has no MLP biases; train with model.bias false to export"),
    ({"logit_softcap": 15.0}, "model.logit_softcap = 15: no transformers class computes it "
                              "(Qwen3ForCausalLM, LlamaForCausalLM and ApertusForCausalLM take no "
                              "logit soft-cap, model.logit_softcap = 0); train with that to "
                              "export"),
    ({"norm": "layernorm"}, "model.norm = layernorm: no transformers class computes it "
                            "(Qwen3ForCausalLM, LlamaForCausalLM and ApertusForCausalLM take "
                            "RMSNorm, model.norm = rmsnorm); train with that to export"),
    ({"bias": True}, "model.bias = true with model.qk_norm: Qwen3ForCausalLM (QK-norm) has no "
                     "MLP biases; train with model.bias false to export"),
    ({"rope": False}, "model.norm = rmsnorm: GPT2LMHeadModel, the transformers class for "
                      "learned positions, computes only model.norm = layernorm; train with that "
                      "(or with model.arch modern: Qwen3ForCausalLM) to export"),
    ({"arch": "gpt2", "mlp": "relu2"}, "model.mlp = relu2: GPT2LMHeadModel, the transformers "
                                       "class for learned positions, computes only model.mlp = "
                                       "gelu; train with that (or with model.arch modern: "
                                       "Qwen3ForCausalLM) to export"),
])
def test_what_no_class_computes_is_refused_in_one_line(fields, message):
    with pytest.raises(UserError) as e:
        layout(dataclasses.replace(MODERN, **fields))
    assert str(e.value) == message


@pytest.mark.parametrize("kind, fields, problem", [
    ("llama", {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}},
     "rope scaling 'linear' (only plain rotary)"),
    ("llama", {"hidden_act": "gelu"}, "hidden_act 'gelu' (only silu)"),
    ("llama", {"attention_bias": True}, "attention_bias and mlp_bias differ (ddpgpt's "
                                        "model.bias is one switch)"),
    ("qwen3", {"attention_bias": True}, "attention_bias true (Qwen3's MLP has none: ddpgpt's "
                                        "model.bias is one switch)"),
    ("apertus", {"hidden_act": "xielu"}, "hidden_act 'xielu' (only relu2, gelu, "
                                         "gelu_pytorch_tanh)"),
])
def test_init_from_refuses_variants_in_one_line(tmp_path, kind, fields, problem):
    hf_model(tmp_path / "hf", kind, **fields)
    spec = str(tmp_path / "hf")
    with pytest.raises(UserError) as e:
        build({"init_from": spec})
    assert str(e.value) == (f"--init-from {spec}: a {kind} variant that ddpgpt's model does not "
                            f"compute: {problem}; start from a plain {llama.CLASSES[kind]} "
                            "checkpoint")


def test_a_piece_set_against_the_weights_is_one_line(tmp_path):
    hf_model(tmp_path / "hf")
    spec = str(tmp_path / "hf")
    with pytest.raises(ConfigError) as e:
        build({"init_from": spec, "mlp": "relu2", "n_kv_head": "4"})
    assert str(e.value) == (f"--init-from {spec}: model.mlp = relu2 (command line) but the weights "
                            "have swiglu; model.n_kv_head = 4 (command line) but the weights have "
                            "2; leave the shape out, it comes from the weights")
    with pytest.raises(ConfigError, match="model.arch = gpt2 .command line. but the weights "
                                          "have modern"):
        build({"init_from": spec, "arch": "gpt2"})
    # what agrees is kept; init_from from GPT-2 weights gives model.arch gpt2 whatever the flags
    assert build({"init_from": spec, "qk_norm": "true"}).model.qk_norm is True


def test_a_transformers_without_the_class_is_one_line(tmp_path, monkeypatch):
    """A ReLU² model under a transformers older than Apertus: one line, nothing written."""
    # the module export imports (transformers puts another in sys.modules once it has loaded)
    monkeypatch.setattr(importlib.import_module("transformers"), "ApertusConfig", None)
    cfg = dataclasses.replace(MODERN, mlp="relu2")
    with pytest.raises(UserError) as e:
        write_model(tmp_path, GPT(cfg, seed=3).state_dict(), cfg, 300, 0, "byte")
    assert str(e.value) == (f"transformers {transformers.__version__} has no ApertusForCausalLM, "
                            "the class that computes this model; upgrade it (pip install -U "
                            "transformers) to export")
    assert list(tmp_path.iterdir()) == []

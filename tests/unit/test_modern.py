"""The modern arch's pieces, each against a forward written out here by hand (rotary as complex
multiplication, attention as an explicit softmax, key/value heads repeated), its init, its
size and cost, and the config that bundles the pieces (model.arch) and switches each one."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from ddpgpt.config import io as config_io
from ddpgpt.config.checks import ConfigError
from ddpgpt.config.model import ModelConfig
from ddpgpt.config.presets import get_preset
from ddpgpt.model.gpt import GPT
from tests.helpers import SMALL

pytestmark = pytest.mark.usefixtures("one_thread")
MODERN = dataclasses.replace(SMALL, arch="modern", n_head=4)


def _tokens(B: int, T: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, SMALL.vocab_size, (B, T), generator=torch.Generator().manual_seed(seed))


def _randomize(model: GPT) -> GPT:
    """Weights away from init (zero projections and unit gains would hide a mix-up)."""
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.3 * noise if p.dim() == 1 else 0.2 * noise)
    return model


def _rms(x, gain, eps):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * gain


def _turn(x, theta):
    """Rotary by hand: dimension pairs (i, i + D/2) as complex numbers times e^(i·pos·θ_i)."""
    T, D = x.size(-2), x.size(-1)
    freqs = theta ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    angle = torch.arange(T, dtype=torch.float64)[:, None] * freqs[None, :]  # (T, D/2)
    z = torch.complex(x[..., :D // 2].double(), x[..., D // 2:].double()) * torch.polar(
        torch.ones_like(angle), angle)
    return torch.cat([z.real, z.imag], dim=-1).float()


def _by_hand(model: GPT, idx: torch.Tensor) -> torch.Tensor:
    """The logits of a rotary, RMSNorm model, from its parameters alone."""
    cfg, p = model.cfg, dict(model.named_parameters())
    B, T = idx.shape
    H, K, D, eps = cfg.n_head, cfg.n_kv_head, cfg.head_dim, cfg.norm_eps
    x = p["wte.weight"][idx]
    for i in range(cfg.n_layer):
        w = {n[len(f"blocks.{i}."):]: t for n, t in p.items() if n.startswith(f"blocks.{i}.")}
        h = _rms(x, w["ln1.weight"], eps)
        q, k, v = (h @ w["attn.qkv.weight"].T).split([H * D, K * D, K * D], dim=-1)
        q, k, v = (t.view(B, T, -1, D) for t in (q, k, v))
        if cfg.qk_norm:
            q, k = _rms(q, w["attn.q_norm.weight"], eps), _rms(k, w["attn.k_norm.weight"], eps)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, heads, T, D)
        q, k = _turn(q, cfg.rope_theta), _turn(k, cfg.rope_theta)
        k, v = (t.repeat_interleave(H // K, dim=1) for t in (k, v))  # query head j -> kv j // (H/K)
        scores = q @ k.transpose(-1, -2) / math.sqrt(D)
        scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
        y = (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, H * D)
        x = x + y @ w["attn.proj.weight"].T
        h = _rms(x, w["ln2.weight"], eps)
        if cfg.mlp == "swiglu":
            a = F.silu(h @ w["mlp.gate.weight"].T) * (h @ w["mlp.fc.weight"].T)
        elif cfg.mlp == "relu2":
            a = torch.relu(h @ w["mlp.fc.weight"].T) ** 2
        else:
            a = F.gelu(h @ w["mlp.fc.weight"].T, approximate="tanh")
        x = x + a @ w["mlp.proj.weight"].T
    x = _rms(x, p["ln_f.weight"], eps)
    logits = x @ (p["wte.weight"] if cfg.tie_embeddings else p["lm_head.weight"]).T
    cap = cfg.logit_softcap
    return cap * torch.tanh(logits / cap) if cap else logits


@pytest.mark.parametrize("fields", [
    {},                                                                 # the bundle
    {"mlp": "relu2", "n_kv_head": 1, "logit_softcap": 3.0},
    {"mlp": "gelu", "qk_norm": False, "tie_embeddings": True, "n_kv_head": 2, "head_dim": 12,
     "rope_theta": 100.0, "norm_eps": 1e-3},
])
def test_the_pieces_compute_the_forward_written_by_hand(fields):
    model = _randomize(GPT(dataclasses.replace(MODERN, **fields), seed=0)).eval()
    idx = _tokens(2, SMALL.block_size)
    with torch.no_grad():
        logits, want = model(idx)[0], _by_hand(model, idx)
    torch.testing.assert_close(logits, want, rtol=0, atol=2e-5)
    assert logits.abs().max() > 1
    if fields.get("logit_softcap"):
        assert logits.abs().max() < fields["logit_softcap"]


@pytest.mark.parametrize("fields", [{}, {"n_kv_head": 1}])
def test_every_gradient_is_that_of_the_forward_written_by_hand(fields):
    """The backward passes written out (RMSNorm on a CPU, the rotary turn, QK-norm and the turn
    over queries and keys together) give autograd's gradients through the forward by hand, for
    every parameter: the QK-norm gains included, which reach the queries and the keys apart."""
    model = _randomize(GPT(dataclasses.replace(MODERN, **fields), seed=0))
    idx = _tokens(2, SMALL.block_size)
    weight = torch.randn(2, SMALL.block_size, SMALL.vocab_size,
                         generator=torch.Generator().manual_seed(4))
    grads = []
    for forward in (lambda: model(idx)[0], lambda: _by_hand(model, idx)):
        model.zero_grad(set_to_none=True)
        (forward() * weight).sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for name, want in grads[1].items():
        torch.testing.assert_close(grads[0][name], want, rtol=0,
                                   atol=2e-5 * max(want.abs().max().item(), 1.0), msg=name)


def test_modern_is_causal_and_has_no_position_embedding():
    model = _randomize(GPT(MODERN, seed=0)).eval()
    assert model.wpe is None and "wpe.weight" not in model.state_dict()
    T = SMALL.block_size
    idx = _tokens(2, T)
    with torch.no_grad():
        base = model(idx)[0]
        for t in range(T):
            changed = idx.clone()
            changed[:, t] = (changed[:, t] + 1) % SMALL.vocab_size
            logits = model(changed)[0]
            torch.testing.assert_close(logits[:, :t], base[:, :t], rtol=0, atol=1e-6)
            assert not torch.allclose(logits[:, t], base[:, t]), t


def test_modern_init():
    """N(0, 0.02) for the embedding, the untied head and the blocks' input matrices; the output
    projections zero; unit gains; no biases. The zero projections are drawn, then zeroed: every
    other weight is the one the same seed gives without zero_init_proj."""
    cfg = ModelConfig(n_layer=3, n_head=4, n_embd=192, block_size=64, vocab_size=256,
                      arch="modern")
    model = GPT(cfg, seed=0)
    drawn = GPT(dataclasses.replace(cfg, zero_init_proj=False), seed=0).state_dict()
    for name, p in model.named_parameters():
        assert not name.endswith("bias"), name
        if name.endswith(("attn.proj.weight", "mlp.proj.weight")):
            assert not p.any(), name
            assert drawn[name].std().item() == pytest.approx(0.02 / math.sqrt(6), rel=0.05)
        elif p.dim() == 2:
            assert p.std().item() == pytest.approx(0.02, rel=0.03), name
            assert torch.equal(p, drawn[name]), name
        else:
            assert torch.equal(p, torch.ones_like(p)), name
    assert model.lm_head.weight.shape == model.wte.weight.shape
    assert not torch.equal(model.lm_head.weight, model.wte.weight)


def test_num_params_and_flops_with_an_untied_head_and_grouped_heads():
    """The untied embedding does no matmul work (a lookup), the head does; there is no position
    embedding. Attention FLOPs follow the query heads' width."""
    cfg = dataclasses.replace(MODERN, n_kv_head=2, head_dim=12).resolved()
    model = GPT(cfg)
    C, V, L, H, K, D, F_ = 32, 64, 2, 4, 2, 12, cfg.mlp_hidden
    per_block = 2 * C + C * (H + 2 * K) * D + 2 * D + H * D * C + 3 * C * F_
    assert F_ == 96  # 8/3 × 32 rounded up to a multiple of 32
    assert model.num_params(non_embedding=False) == 2 * V * C + L * per_block + C
    assert model.num_params() == V * C + L * per_block + C
    assert model.flops_per_token(16) == 6 * model.num_params() + 12 * L * 16 * H * D


# ---- the config ----------------------------------------------------------------------------------

def test_the_arch_bundles_the_pieces_and_each_can_be_switched(tmp_path):
    gpt2, modern = ModelConfig(arch="gpt2").resolved(), ModelConfig().resolved()
    assert (gpt2.rope, gpt2.norm, gpt2.qk_norm, gpt2.mlp, gpt2.bias, gpt2.tie_embeddings,
            gpt2.zero_init_proj) == (False, "layernorm", False, "gelu", True, True, False)
    assert (modern.rope, modern.norm, modern.qk_norm, modern.mlp, modern.bias,
            modern.tie_embeddings, modern.zero_init_proj) == (True, "rmsnorm", True, "swiglu",
                                                              False, False, True)
    assert (gpt2.mlp_hidden, modern.mlp_hidden, modern.n_kv_head, modern.head_dim) == (
        1024, 704, 4, 64)
    # a later layer's arch decides the pieces an earlier one left unset; a set piece stays
    cfg = config_io.build("tiny", None, {"model": {"arch": "modern", "mlp": "relu2",
                                                   "tie_embeddings": "true"}}).model.resolved()
    assert (cfg.rope, cfg.mlp, cfg.tie_embeddings, cfg.mlp_hidden) == (True, "relu2", True, 1024)
    one = config_io.build(None, None, {"model": {"rope": "false"}}).model.resolved()
    assert (one.arch, one.rope, one.norm, one.mlp) == ("modern", False, "rmsnorm", "swiglu")
    one = config_io.build(None, None, {"model": {"arch": "gpt2", "rope": "true"}}).model.resolved()
    assert (one.arch, one.rope, one.norm, one.mlp) == ("gpt2", True, "layernorm", "gelu")
    # new runs are modern, the GPT-2 presets GPT-2's, a config saved before model.arch gpt2
    assert [get_preset(name).model.arch for name in ("tiny", "speedrun", "small", "gpt2-124m",
                                                     "gpt2-350m")] == ["modern"] * 3 + ["gpt2"] * 2
    saved = config_io.from_dict({"model": {"n_layer": 2}})
    assert (saved.model.arch, saved.model.resolved().rope) == ("gpt2", False)
    # unset pieces stay unset in a TOML file and read back the same
    cfg = config_io.build(None, None, {"model": {"arch": "modern", "qk_norm": "false"}})
    text = config_io.to_toml(cfg)
    assert "qk_norm = false" in text and "rope =" not in text
    (tmp_path / "run.toml").write_text(text)
    assert config_io.build(None, str(tmp_path / "run.toml"), {}) == cfg


@pytest.mark.parametrize("fields, message", [
    ({"norm": "batchnorm"}, "model.norm = 'batchnorm'; choose one of layernorm, rmsnorm"),
    ({"mlp": "swigl"}, "model.mlp = 'swigl' (did you mean swiglu?); choose one of gelu, relu2, "
                       "swiglu"),
    ({"arch": "llama"}, "model.arch = 'llama'; choose one of gpt2, modern"),
    ({"n_kv_head": 3}, "model.n_kv_head = 3 must divide model.n_head = 4"),
    ({"n_head": 2, "head_dim": 15}, "rotary positions turn pairs of dimensions: the head width 15 "
                                    "(model.n_embd / model.n_head, or model.head_dim) must be "
                                    "even"),
    ({"logit_softcap": -1.0}, "model.logit_softcap = -1 must be >= 0 (0: off)"),
])
def test_bad_pieces_are_one_line(fields, message):
    with pytest.raises(ConfigError) as e:
        dataclasses.replace(MODERN, **fields)
    assert str(e.value) == f"invalid config: {message}"

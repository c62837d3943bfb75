"""The single-device GPT: seeded init, causality, the tied head, the loss, FLOPs and generation,
each against a hand computation."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from ddpgpt.config.model import ModelConfig
from ddpgpt.model.gpt import GPT
from tests.helpers import SMALL, assert_greedy_agrees

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def model() -> GPT:
    return GPT(SMALL, seed=0).eval()


def _tokens(B: int, T: int, seed: int = 0, vocab: int = SMALL.vocab_size) -> torch.Tensor:
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


def _states_equal(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


# ---- init ------------------------------------------------------------------------------------

def test_init_depends_on_the_seed_only():
    torch.manual_seed(1)
    a = GPT(SMALL, seed=5)
    torch.manual_seed(2)
    torch.rand(100)  # a different global RNG state and position
    b = GPT(SMALL, seed=5)
    c = GPT(SMALL, seed=6)
    assert _states_equal(a, b)
    sa, sc = a.state_dict(), c.state_dict()
    assert all(not torch.equal(sa[k], sc[k])
               for k in sa if k.endswith("weight") and sa[k].dim() == 2)


def test_init_statistics():
    """GPT-2 init: N(0, 0.02) for matrices and embeddings, N(0, 0.02/sqrt(2·L)) for the residual
    projections, zero biases, unit LayerNorm gains. With >= 36k samples per tensor the sample std
    is within 0.5 % of the true one (1 sigma); the tolerance is 3 %."""
    L = 3
    m = GPT(ModelConfig(n_layer=L, n_head=4, n_embd=192, block_size=64, vocab_size=256,
                        arch="gpt2"), seed=0)
    residual = 0.02 / math.sqrt(2 * L)
    seen = {"residual": 0, "normal": 0, "bias": 0, "norm": 0}
    for name, p in m.named_parameters():
        if name.endswith(("attn.proj.weight", "mlp.proj.weight")):
            kind, std = "residual", residual
        elif p.dim() == 2:
            kind, std = "normal", 0.02
        elif ".ln" in name or name.startswith("ln_f"):
            kind = "norm"
            expected = torch.ones_like(p) if name.endswith("weight") else torch.zeros_like(p)
            assert torch.equal(p, expected), name
        else:
            kind = "bias"
            assert torch.equal(p, torch.zeros_like(p)), name
        if kind in ("residual", "normal"):
            assert p.std().item() == pytest.approx(std, rel=0.03), name
            assert abs(p.mean().item()) < 5 * std / math.sqrt(p.numel()), name
        seen[kind] += 1
    # per block: qkv, fc (normal); attn.proj, mlp.proj (residual); plus wte and wpe
    assert seen == {"residual": 2 * L, "normal": 2 * L + 2, "bias": 4 * L, "norm": 4 * L + 2}


def test_unresolved_vocab_is_rejected():
    with pytest.raises(ValueError, match="GPT needs a resolved vocab_size"):
        GPT(ModelConfig(n_layer=1, n_head=1, n_embd=8, block_size=4, vocab_size=0))


# ---- forward -----------------------------------------------------------------------------------

def test_causal(model):
    T = SMALL.block_size
    idx = _tokens(2, T)
    base = model(idx)[0]
    for t in range(T):
        changed = idx.clone()
        changed[:, t] = (changed[:, t] + 1) % SMALL.vocab_size
        logits = model(changed)[0]
        assert torch.equal(logits[:, :t], base[:, :t]), t
        # the change is visible where it happens
        assert not torch.allclose(logits[:, t], base[:, t]), t


def test_head_is_tied_to_the_token_embedding(model):
    V, C = SMALL.vocab_size, SMALL.n_embd
    assert [n for n, p in model.named_parameters() if p.shape == (V, C)] == ["wte.weight"]
    hidden = {}
    model.ln_f.register_forward_hook(lambda mod, inp, out: hidden.setdefault("h", out))
    logits = model(_tokens(2, 8))[0]
    torch.testing.assert_close(logits, hidden["h"] @ model.wte.weight.T, rtol=1e-5, atol=1e-6)


def test_head_gradient_reaches_the_embedding(model):
    """Rows of wte for tokens absent from the input get gradient only through the head:
    d loss / d W[v] = sum over positions of dlogits[:, v] * h."""
    V = SMALL.vocab_size
    idx = _tokens(2, 8, vocab=10)  # input tokens 0..9 only
    targets = _tokens(2, 8, seed=1)
    hidden = {}
    model.ln_f.register_forward_hook(lambda mod, inp, out: hidden.setdefault("h", out))
    logits, loss = model(idx, targets)
    logits.retain_grad()
    loss.backward()
    h = hidden["h"].detach().reshape(-1, SMALL.n_embd)
    head_grad = logits.grad.reshape(-1, V).T @ h  # (V, C)
    torch.testing.assert_close(model.wte.weight.grad[10:], head_grad[10:], rtol=1e-4, atol=1e-7)
    assert model.wte.weight.grad[10:].abs().sum() > 0


def test_loss_is_cross_entropy(model):
    idx, targets = _tokens(3, 12), _tokens(3, 12, seed=1)
    logits, loss = model(idx, targets)
    assert torch.equal(loss, F.cross_entropy(logits.reshape(-1, SMALL.vocab_size),
                                             targets.reshape(-1)))
    _, total = model(idx, targets, reduction="sum")
    torch.testing.assert_close(total, loss * targets.numel(), rtol=1e-5, atol=0)


def test_targets_of_minus_one_are_ignored(model):
    idx, targets = _tokens(2, 12), _tokens(2, 12, seed=1)
    targets[1] = -1
    targets[0, :3] = -1
    logits, loss = model(idx, targets)
    _, total = model(idx, targets, reduction="sum")
    # the 9 counted positions
    kept = F.cross_entropy(logits[0, 3:], targets[0, 3:], reduction="none")
    torch.testing.assert_close(loss, kept.mean(), rtol=1e-6, atol=0)
    torch.testing.assert_close(total, kept.sum(), rtol=1e-6, atol=0)


def test_longer_than_block_size_is_rejected(model):
    with pytest.raises(ValueError) as e:
        model(_tokens(1, SMALL.block_size + 1))
    assert str(e.value) == "sequence of 17 tokens exceeds block_size 16"


# ---- size and cost ---------------------------------------------------------------------------

def test_num_params_and_flops(model):
    C, V, L, T = SMALL.n_embd, SMALL.vocab_size, SMALL.n_layer, SMALL.block_size
    per_block = (2 * 2 * C + (3 * C * C + 3 * C) + (C * C + C) + (4 * C * C + 4 * C)
                 + (4 * C * C + C))
    total = V * C + T * C + L * per_block + 2 * C
    assert (model.num_params(non_embedding=False) == total
            == sum(p.numel() for p in model.parameters()))
    assert model.num_params() == total - T * C  # the position embedding only
    for seq_len in (1, 8, 16):
        assert model.flops_per_token(seq_len) == 6 * model.num_params() + 12 * L * seq_len * C


# ---- generation ------------------------------------------------------------------------------

def _greedy(model: GPT, idx: torch.Tensor, n: int) -> torch.Tensor:
    with torch.no_grad():
        for _ in range(n):
            logits = model(idx[:, -model.cfg.block_size:])[0][:, -1]
            idx = torch.cat([idx, logits.argmax(-1, keepdim=True)], dim=1)
    return idx


def test_generate_keeps_the_prompt_and_appends(model):
    prompt = _tokens(2, 5)
    out = model.generate(prompt, 7, generator=torch.Generator().manual_seed(0))
    assert out.shape == (2, 12)
    assert torch.equal(out[:, :5], prompt)
    assert out.min() >= 0 and out.max() < SMALL.vocab_size


def test_generate_top_k_1_is_greedy(model):
    prompt = _tokens(2, 4)
    out = model.generate(prompt, 8, temperature=0.7, top_k=1,
                         generator=torch.Generator().manual_seed(3))
    assert_greedy_agrees(out, _greedy(model, prompt, 8),  # KV cache against whole contexts
                         lambda prefix: model(prefix[:, -model.cfg.block_size:])[0][:, -1])


def test_generate_is_reproducible_with_a_generator(model):
    prompt = _tokens(2, 3)

    def sample(seed):
        return model.generate(prompt, 20, top_k=10, generator=torch.Generator().manual_seed(seed))

    assert torch.equal(sample(1), sample(1))
    assert not torch.equal(sample(1), sample(2))


def test_generate_crops_context_to_block_size(model):
    """A prompt of block_size tokens is read whole for the first new token; the window then
    restarts from the last block_size // 2 tokens (see test_generate.py for the whole rule)."""
    prompt = _tokens(1, SMALL.block_size)
    out = model.generate(prompt, 2, top_k=1)
    assert out.shape == (1, SMALL.block_size + 2)
    def last(prefix):
        return model(prefix[:, -SMALL.block_size:])[0][:, -1]

    assert_greedy_agrees(out[:, :-1], _greedy(model, prompt, 1), last)  # the KV cache's
    keep = out[:, SMALL.block_size + 1 - SMALL.block_size // 2:SMALL.block_size + 1]
    assert_greedy_agrees(out[:, -1:], _greedy(model, keep, 1)[:, -1:],
                         lambda _: model(keep)[0][:, -1])


@pytest.mark.parametrize("top_k", [None, 5])
def test_generate_never_samples_the_padding_ids(model, top_k):
    """The vocabulary may be padded to a multiple of 64 (GPT-2's 50,257 ids -> 50,304 rows):
    even a model that puts nearly all its mass on the padding rows never emits one."""
    tokenizer_vocab = 40
    with torch.no_grad():
        model.wte.weight[tokenizer_vocab:] *= 50  # the padding rows now win every logit
    prompt = _tokens(4, 3, vocab=tokenizer_vocab)
    unmasked = model.generate(prompt, 30, top_k=top_k, generator=torch.Generator().manual_seed(0))
    assert unmasked[:, 3:].max() >= tokenizer_vocab  # the case the mask exists for
    out = model.generate(prompt, 30, top_k=top_k, generator=torch.Generator().manual_seed(0),
                         vocab_size=tokenizer_vocab)
    assert out[:, 3:].max() < tokenizer_vocab

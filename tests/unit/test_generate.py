"""Generation with a KV cache against the no-cache path (the oracle: every token re-encodes its
whole context), for both archs: past block_size, learned positions restart the window and rotary
ones slide it by one token. And the padding rows' mask."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from ddpgpt.model.attention import KVCache, band
from ddpgpt.model.gpt import GPT
from tests.helpers import SMALL, assert_greedy_agrees

pytestmark = pytest.mark.usefixtures("one_thread")
BLOCK = SMALL.block_size  # 16
# Rotary, QK-norm, SwiGLU, one key/value head; the output projections drawn (zero ones would make
# every block the identity, and any cache equal to any other).
MODERN = dataclasses.replace(SMALL, arch="modern", n_kv_head=1, zero_init_proj=False)
ARCHS = {"gpt2": SMALL, "modern": MODERN}


@pytest.fixture(scope="module")
def model() -> GPT:
    return GPT(SMALL, seed=0).eval()


@pytest.fixture(scope="module", params=list(ARCHS))
def either(request) -> GPT:
    return GPT(ARCHS[request.param], seed=0).eval()


def _tokens(B: int, T: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, SMALL.vocab_size, (B, T), generator=torch.Generator().manual_seed(seed))


def _context_lengths(model: GPT, prompt: torch.Tensor, n: int, use_cache: bool) -> list[int]:
    """The number of tokens each forward call of `generate` was given."""
    seen = []
    hook = model.register_forward_pre_hook(lambda m, args: seen.append(args[0].size(1)))
    try:
        model.generate(prompt, n, top_k=1, use_cache=use_cache)
    finally:
        hook.remove()
    return seen


def test_cached_logits_equal_a_full_forward(either):
    """Each token's logits from the cache equal those of a forward over the whole prefix."""
    model, idx = either, _tokens(3, BLOCK, seed=1)
    cache = KVCache(SMALL.n_layer, BLOCK, slide=model.cfg.rope)
    with torch.no_grad():
        steps = [model(idx[:, :5], cache=cache)[0][:, -1]]
        steps += [model(idx[:, t:t + 1], cache=cache)[0][:, -1] for t in range(5, BLOCK)]
        for t, logits in zip(range(5, BLOCK + 1), steps):
            torch.testing.assert_close(logits, model(idx[:, :t])[0][:, -1], rtol=0, atol=1e-5)
    assert cache.length == BLOCK


@pytest.mark.parametrize("prompt_len, new_tokens", [(4, 5), (4, BLOCK), (4, 3 * BLOCK + 5),
                                                     (3 * BLOCK, 5)])
@pytest.mark.parametrize("top_k", [None, 10])
def test_cache_gives_the_no_cache_tokens(either, prompt_len, new_tokens, top_k):
    """Same seed, same tokens, within the window and well past it (the window restarts several
    times, or slides), and from a prompt longer than the window, for a batch of three different
    prompts."""
    prompt = _tokens(3, prompt_len, seed=new_tokens)
    for seed in (0, 1, 2):
        runs = [either.generate(prompt, new_tokens, temperature=1.0, top_k=top_k,
                                generator=torch.Generator().manual_seed(seed), use_cache=c)
                for c in (True, False)]
        assert torch.equal(runs[0], runs[1]), seed
        assert runs[0].shape == (3, prompt_len + new_tokens)


def test_the_rotary_cache_slides_and_each_token_sees_its_last_block_at_every_layer():
    """Past block_size the rotary cache overwrites its oldest keys: the prompt once, then one
    token per call. Its logits are those of the no-cache oracle, a forward in which every token
    attends to its last block_size tokens at every layer (the band), over all the tokens the last
    one depends on; with one layer that is a plain forward over the last block_size tokens."""
    model = GPT(MODERN, seed=0).eval()
    assert _context_lengths(model, _tokens(1, 4), 3 * BLOCK, use_cache=True) == (
        [4] + [1] * (3 * BLOCK - 1))
    idx = _tokens(3, 4 * BLOCK, seed=2)
    reach = MODERN.n_layer * (BLOCK - 1) + 1
    cache = KVCache(MODERN.n_layer, BLOCK, slide=True)
    with torch.no_grad():
        model(idx[:, :5], cache=cache)
        for t in range(5, idx.size(1)):
            cached = model(idx[:, t:t + 1], cache=cache)[0][:, -1]
            oracle = model(idx[:, max(0, t + 1 - reach):t + 1], window=BLOCK)[0][:, -1]
            torch.testing.assert_close(cached, oracle, rtol=0, atol=1e-5)
        assert cache.length == 4 * BLOCK
        # a sliding cache is not a fresh forward over the last block_size: upper layers' keys
        # carry what each token saw of tokens already out of the window
        fresh = model(idx[:, -BLOCK:])[0][:, -1]
        assert (fresh - cached).abs().max() > 1e-3
        one = GPT(dataclasses.replace(MODERN, n_layer=1), seed=0).eval()
        torch.testing.assert_close(one(idx, window=BLOCK)[0][:, -1],
                                   one(idx[:, -BLOCK:])[0][:, -1], rtol=0, atol=1e-5)
    # each token sees itself and the window - 1 before it; as wide as the sequence, it is causal
    assert band(4, 2, "cpu").int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0],
                                                [0, 0, 1, 1]]
    assert torch.equal(band(5, 5, "cpu"), torch.ones(5, 5, dtype=torch.bool).tril())


def test_the_window_restarts_from_its_last_half(model):
    """Past block_size the context restarts from the last block_size // 2 tokens and grows back:
    a prompt of 4, then 4..16 tokens of context, then 8..16, again and again."""
    half = BLOCK // 2
    expected = list(range(4, BLOCK + 1)) + 2 * list(range(half, BLOCK + 1)) + [half]
    n = len(expected)
    assert _context_lengths(model, _tokens(1, 4), n, use_cache=False) == expected
    # With the cache: the prompt once, then one token per call, and each restart re-encodes
    # the half it keeps.
    assert _context_lengths(model, _tokens(1, 4), n, use_cache=True) == (
        [4] + [1] * (BLOCK - 4) + 2 * ([half] + [1] * half) + [half])


def test_a_prompt_longer_than_the_window_keeps_its_end(model):
    prompt = _tokens(2, 3 * BLOCK, seed=5)
    out = model.generate(prompt, 1, top_k=1)
    with torch.no_grad():
        want = model(prompt[:, -BLOCK:])[0][:, -1].argmax(-1)
    assert_greedy_agrees(out, torch.cat([prompt, want[:, None]], dim=1),
                         lambda prefix: model(prefix[:, -BLOCK:])[0][:, -1])


def test_the_cache_refuses_what_it_cannot_hold(model):
    cache = KVCache(SMALL.n_layer, BLOCK)
    with torch.no_grad():
        model(_tokens(1, 4), cache=cache)
        with pytest.raises(ValueError, match="one token at a time"):
            model(_tokens(1, 2), cache=cache)
        for t in range(4, BLOCK):
            model(_tokens(1, 1, seed=t), cache=cache)
        with pytest.raises(ValueError, match="exceeds block_size"):  # positions end there
            model(_tokens(1, 1), cache=cache)


# ---- the padding rows ------------------------------------------------------------------------

def test_vocab_limit_masks_the_padding_rows():
    """Ids from vocab_limit on get -inf: the loss is the cross-entropy over the live ids alone,
    and the padding rows get no gradient, whatever their weights."""
    limit = 40
    model = GPT(dataclasses.replace(SMALL, vocab_limit=limit), seed=0)
    with torch.no_grad():
        model.wte.weight[limit:] = 0.0  # zero rows: logit 0, above most live logits
    x, y = _tokens(2, 8, seed=3) % limit, _tokens(2, 8, seed=4) % limit
    logits, loss = model(x, y)
    assert torch.isinf(logits[..., limit:]).all() and torch.isfinite(logits[..., :limit]).all()
    want = F.cross_entropy(logits[..., :limit].reshape(-1, limit), y.reshape(-1))
    torch.testing.assert_close(loss, want, rtol=0, atol=1e-6)
    loss.backward()
    assert model.wte.weight.grad[limit:].abs().max() == 0
    assert model.wte.weight.grad[:limit].abs().max() > 0


@pytest.mark.parametrize("use_cache", [True, False])
def test_temperature_zero_is_greedy_and_equals_top_k_one(model, use_cache):
    """temperature 0: each new token is the argmax of a full forward's last logits (the oracle,
    within the tokenizer's vocabulary), the same tokens as top_k=1, whatever the generator."""
    prompt, vocab = _tokens(2, 5, seed=7), SMALL.vocab_size - 3
    greedy = model.generate(prompt, 6, temperature=0, vocab_size=vocab, use_cache=use_cache,
                            generator=torch.Generator().manual_seed(1))
    expected = prompt
    with torch.no_grad():
        for _ in range(6):
            logits = model(expected)[0][:, -1, :vocab]
            expected = torch.cat([expected, logits.argmax(-1, keepdim=True)], dim=1)
    if use_cache:  # the cache's one-row products round otherwise than the whole context's
        assert_greedy_agrees(greedy, expected, lambda prefix: model(prefix)[0][:, -1, :vocab])
    else:  # the oracle's own forward, token for token: bitwise
        assert torch.equal(greedy, expected)
    top1 = model.generate(prompt, 6, temperature=1.0, top_k=1, vocab_size=vocab,
                          use_cache=use_cache, generator=torch.Generator().manual_seed(2))
    assert torch.equal(greedy, top1)

"""model.doc_mask: attention stops at document boundaries inside a row, as a property (a document's
tokens change nothing in the other documents' logits) and against an oracle (each document run
alone); and how the config turns it on."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from ddpgpt import cli
from ddpgpt.data.shards import TokenDataset
from ddpgpt.model.attention import documents
from ddpgpt.model.gpt import GPT
from ddpgpt.run.preflight import resolve
from tests.helpers import SMALL, write_dataset

pytestmark = pytest.mark.usefixtures("one_thread")
BOS = 1
T = 16
# three documents in a row: a continuation (no BOS), then two that begin with BOS
SEGMENTS = [(0, 4), (4, 10), (10, T)]
ARCHS = {"gpt2": dataclasses.replace(SMALL, bos_id=BOS),
         "modern": dataclasses.replace(SMALL, arch="modern", n_head=4, n_kv_head=2, bos_id=BOS)}


def _row(seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    row = torch.randint(2, SMALL.vocab_size, (2, T), generator=gen)
    for start, _ in SEGMENTS[1:]:
        row[:, start] = BOS
    return row


def _model(arch: str, doc_mask: bool) -> GPT:
    model = GPT(dataclasses.replace(ARCHS[arch], doc_mask=doc_mask), seed=3).eval()
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():  # away from init: zero projections would hide a leak
        for p in model.parameters():
            p.copy_(1 + 0.3 * torch.randn(p.shape, generator=gen) if p.dim() == 1
                    else 0.2 * torch.randn(p.shape, generator=gen))
    return model


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("changed", range(len(SEGMENTS)))
def test_a_document_does_not_reach_the_others(arch, changed):
    row = _row(0)
    other = row.clone()
    start, end = SEGMENTS[changed]
    other[:, start + 1:end] = _row(1)[:, start + 1:end]  # its tokens, not where it begins
    with torch.no_grad():
        masked = _model(arch, True)
        a, b = masked(row)[0], masked(other)[0]
        plain = _model(arch, False)
        c, d = plain(row)[0], plain(other)[0]
    for i, (s, e) in enumerate(SEGMENTS):
        if i != changed:
            assert torch.equal(a[:, s:e], b[:, s:e]), (i, "changed with the mask")
    assert not torch.equal(a[:, start + 1:end], b[:, start + 1:end])
    if changed < len(SEGMENTS) - 1:  # without the mask the later documents see it
        assert not torch.equal(c[:, end:], d[:, end:])


@pytest.mark.parametrize("arch", ARCHS)
def test_each_document_as_if_alone(arch):
    """With rotary positions a document's logits are those of the document run alone (up to
    float rounding); with learned positions, those of it at its place after padding that it
    cannot see."""
    row = _row(0)
    model = _model(arch, True)
    with torch.no_grad():
        logits = model(row)[0]
        for s, e in SEGMENTS:
            if model.cfg.rope:
                alone = model(row[:, s:e])[0]
            else:
                alone = model(torch.cat([torch.full((2, s), BOS), row[:, s:e]], 1))[0][:, s:]
            torch.testing.assert_close(logits[:, s:e], alone, rtol=1e-5, atol=1e-5)


def test_mask_is_causal_within_segments():
    idx = torch.tensor([[5, 5, BOS, 5, BOS, BOS]])
    want = torch.zeros(6, 6, dtype=torch.bool)
    for s, e in ((0, 2), (2, 4), (4, 5), (5, 6)):
        want[s:e, s:e] = torch.ones(e - s, e - s, dtype=torch.bool).tril()
    assert torch.equal(documents(idx, BOS)[0, 0] == 0, want)


@pytest.mark.parametrize("align, flag, want", [("stream", [], False), ("bos", [], True),
                                                ("bos", ["--no-model.doc-mask"], False),
                                                ("stream", ["--model.doc-mask"], True)])
def test_doc_mask_follows_align_unless_set(tmp_path, align, flag, want):
    path = write_dataset(tmp_path / "d", np.arange(500) % 50, np.arange(100) % 50,
                         vocab_size=64, eot_id=7)
    ns = cli._build_parser().parse_args(["train", "--data", str(path), "--data.align", align,
                                         *flag])
    cfg = cli.train_config({k: v for k, v in vars(ns).items() if k not in ("command", "debug")})[0]
    model = resolve(cfg, TokenDataset(path), 1).model
    assert model.doc_mask is want and model.bos_id == 7


@pytest.mark.parametrize("arch", ARCHS)
def test_mask_under_bf16_autocast(arch):
    """The CPU's additive (fp32) mask under bf16 autocast."""
    row, model = _row(0), _model(arch, True)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(row)[0]
    with torch.no_grad():
        want = model(row)[0]
    assert logits.dtype == torch.bfloat16
    torch.testing.assert_close(logits.float(), want, rtol=0.1, atol=0.3)

"""The attention rows of `ddpgpt check`: FlexAttention's block mask against SDPA's dense mask, the
same model and rows (documents that cross row starts; the sliding band), its logits and every
gradient; and what it costs against unmasked causal attention at T=1,024, where the point of it
is to stay within 1.2× of the causal kernel when the dense mask costs several times it.

The equality rows run wherever torch has FlexAttention (on a CPU its backward is
model/flex_cpu.py's); the speed row on CUDA only, its goal being a GPU kernel's (a CPU's figures
are in docs/performance.md). Elsewhere they are listed as not run, saying what is missing."""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time

import torch

from ddpgpt.commands.check.report import FAIL, PASS, Row, within
from ddpgpt.commands.check.training import error_line, lacking
from ddpgpt.config.model import ModelConfig
from ddpgpt.model import flex
from ddpgpt.model.attention import CausalSelfAttention, documents
from ddpgpt.model.gpt import GPT

BOS = 1
# fp32 with float32 matmuls at full precision (no TF32): the two kernels differ in the order they
# sum; relative to the largest value compared.
EQUAL = {"cpu": 1e-5, "cuda": 1e-4}
SPEED_GOAL = 1.2  # flex's time over unmasked causal attention's, forward and backward
MODELS = {  # check: (the model, its window)
    "flex · documents · gpt2 · logits and gradients": (
        ModelConfig(n_layer=2, n_head=4, n_embd=128, block_size=384, vocab_size=512,
                    arch="gpt2", doc_mask=True, bos_id=BOS), 0),
    "flex · documents + band · modern, grouped-query heads · logits and gradients": (
        ModelConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=128, block_size=384,
                    vocab_size=512, arch="modern", doc_mask=True, bos_id=BOS), 100),
}
SPEED = "speed flex · T=1024 · documents ~1000 · against causal"
SPEED_SHAPE = (8, 1024, 768, 12)  # rows, T, width, heads: gpt2-124m's attention
SPEED_STEPS = (3, 20)             # warm-up (the compile), timed
DENSE = "the same model under sdpa's dense mask"


def ids(B: int, T: int, every: int, vocab: int, device, seed: int = 0) -> torch.Tensor:
    """(B, T) ids with a document start about every `every` tokens, none at a row's first: each
    row begins inside a document that started before it."""
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(2, vocab, (B, T), generator=gen)
    starts = torch.rand(B, T, generator=gen) < 1 / every
    starts[:, 0] = False
    idx[starts] = BOS
    return idx.to(device)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


@contextlib.contextmanager
def full_fp32():
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


def rows(device: str, selected, say) -> list[Row]:
    """Every attention row `selected` lets run, on `device` (W=1)."""
    checks = [c for c in (*MODELS, SPEED) if selected(c)]
    missing = lacking(device)
    if missing:
        return [Row.needs(c, device, 1, DENSE if c in MODELS else "causal attention, no mask",
                          missing) for c in checks]
    out = []
    for check in checks:
        if check == SPEED and device != "cuda":
            out.append(Row.needs(SPEED, device, 1, "causal attention, no mask",
                                 f"CUDA (its goal is a GPU kernel's, not {device}'s)"))
            continue
        start = time.perf_counter()
        try:
            out.append(speed(device) if check == SPEED else same(check, device))
        except Exception as e:  # noqa: BLE001 -- a row's failure is reported, not raised
            out.append(Row(check, device, 1, DENSE if check in MODELS else "causal attention",
                           error_line(e), FAIL))
        say(f"{check}: {time.perf_counter() - start:.1f} s")
    return out


def same(check: str, device: str) -> Row:
    """The model's logits and gradients under both masks (fp32), the largest relative
    difference."""
    cfg, window = MODELS[check]
    idx = ids(4, cfg.block_size, 60, cfg.vocab_size, device)
    got = {}
    with full_fp32():
        for attention in ("sdpa", "flex"):
            model = GPT(dataclasses.replace(cfg, attention=attention), seed=0)
            gen = torch.Generator().manual_seed(7)
            with torch.no_grad():  # away from init: zero projections would hide a difference
                for p in model.parameters():
                    p.copy_(1 + 0.3 * torch.randn(p.shape, generator=gen) if p.dim() == 1
                            else 0.1 * torch.randn(p.shape, generator=gen))
            model.to(device)
            logits, loss = model(idx, idx, window=window)
            loss.backward()
            got[attention] = [logits.detach()] + [p.grad for p in model.parameters()]
    rel = [((a - b).abs().max() / b.abs().max()).item() for a, b in zip(got["flex"], got["sdpa"])]
    row = within(check, device, 1, DENSE, max(rel), EQUAL[device],
                 "max rel Δ logits and gradients")
    row.figure += f"; logits {rel[0]:.1e}"
    return row


def speed(device: str) -> Row:
    """One attention layer of gpt2-124m's width (12 heads of 64), 8 rows of 1,024 tokens with
    documents of ~1,000 that cross row starts, forward and backward in bf16 under autocast: the
    median of 20 after 3 (SPEED_SHAPE, SPEED_STEPS), flex's block mask, unmasked causal and the
    dense mask taking turns."""
    B, T, width, heads = SPEED_SHAPE
    warmup, timed = SPEED_STEPS
    cfg = ModelConfig(n_layer=1, n_head=heads, n_embd=width, block_size=T, vocab_size=512,
                      arch="gpt2").resolved()
    layer = CausalSelfAttention(cfg).to(device)
    idx = ids(B, T, 1000, 512, device)
    x = torch.randn(B, T, width, device=device, requires_grad=True)
    masks = {"causal": None, "flex": flex.block_mask(idx, BOS), "dense": documents(idx, BOS)}
    times: dict[str, list[float]] = {k: [] for k in masks}
    autocast = torch.autocast(device, dtype=torch.bfloat16)
    for i in range(warmup + timed):
        for name, mask in masks.items():
            sync(device)
            start = time.perf_counter()
            with autocast:
                layer(x, mask=mask).float().sum().backward()
            sync(device)
            if i >= warmup:
                times[name].append(time.perf_counter() - start)
    ms = {k: statistics.median(t) * 1e3 for k, t in times.items()}
    ratio = ms["flex"] / ms["causal"]
    figure = (f"flex {ratio:.2f}× causal ({ms['flex']:.2f} vs {ms['causal']:.2f} ms), dense "
              f"mask {ms['dense'] / ms['causal']:.2f}× (goal ≤ {SPEED_GOAL}×)")
    return Row(SPEED, device, 1, "causal attention, no mask", figure,
               PASS if ratio <= SPEED_GOAL else FAIL)

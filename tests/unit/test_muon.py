"""Muon + AdamW (ddpgpt/muon.py) in one process, against oracles written here.

Newton-Schulz against the SVD: for G = U·S·Vᵀ the result must be U·f(S)·Vᵀ (the same singular
vectors: Uᵀ·O·V diagonal) with f(σ) in the documented band. Measured on this CPU in fp32 with 5
iterations: off-diagonal entries of Uᵀ·O·V below 1e-5; every σ of at least 1/100 of the largest
maps into [0.6818, 1.2016]; smaller ones are scaled up but stay positive and below the band's top.
"""

import math

import pytest
import torch

from ddpgpt.config import ConfigError, ModelConfig, OptimConfig, RunConfig, TrainConfig
from ddpgpt.model import GPT
from ddpgpt.muon import make_muon, momentum_at, newton_schulz, owners
from ddpgpt.optim import make_optimizer, set_lr

BAND = (0.68, 1.21)


def orthogonal(n: int, gen: torch.Generator) -> torch.Tensor:
    return torch.linalg.qr(torch.randn(n, n, generator=gen))[0]


def matrices():
    gen = torch.Generator().manual_seed(0)
    yield "square", torch.randn(64, 64, generator=gen)
    yield "wide", torch.randn(32, 96, generator=gen)
    yield "tall", torch.randn(96, 32, generator=gen)
    for cond in (1e2, 1e4):  # singular values log-spaced from 1 down to 1/cond
        s = torch.logspace(0, -math.log10(cond), 48)
        yield f"cond {cond:g}", orthogonal(64, gen)[:, :48] @ torch.diag(s) @ orthogonal(48, gen).T


@pytest.mark.parametrize("name, g", list(matrices()), ids=[n for n, _ in matrices()])
def test_newton_schulz_keeps_singular_vectors_and_equalizes_values(name, g):
    out = newton_schulz(g)
    u, s, vh = torch.linalg.svd(g, full_matrices=False)
    d = u.T @ out @ vh.T  # diag(f(S)) if the singular vectors are kept
    values = d.diagonal()
    assert (d - torch.diag(values)).abs().max() < 1e-4, name
    assert (values > 0).all() and values.max() <= BAND[1], name
    well = values[s >= s.max() / 100]
    assert well.min() >= BAND[0], (name, well.min())
    if s.min() >= s.max() / 100:  # the oracle U·Vᵀ, reached to within the band
        assert (out - u @ vh).norm() / (u @ vh).norm() < 1 - BAND[0]


def test_owners_balance_the_sizes():
    sizes = [300, 100, 300, 100, 400]
    assert owners(sizes, 1) == [0] * 5
    # 400 -> rank 0; 300, 300 -> rank 1 (600); 100, 100 -> rank 0 (600): balanced
    assert owners(sizes, 2) == [1, 0, 1, 0, 0]
    load = [sum(s for s, o in zip(sizes, owners(sizes, 3)) if o == r) for r in range(3)]
    assert load == [400, 400, 400]


def reference_muon_step(model: GPT, grads: dict, cfg: OptimConfig, lr: float, momentum: float,
                        buffers: dict, adam: torch.optim.AdamW) -> None:
    """Plain Muon: Nesterov momentum, the quintic Newton-Schulz written out, RMS-matched scale;
    torch's own AdamW for everything that is not a block matrix."""
    a, b, c = 3.4445, -4.7750, 2.0315
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.grad = grads[name].clone()
            if not (name.startswith("blocks.") and p.dim() == 2):
                continue
            buf = buffers.setdefault(name, torch.zeros_like(p))
            buf.mul_(momentum).add_(p.grad, alpha=1 - momentum)
            u = p.grad * (1 - momentum) + buf * momentum
            x = u.T if u.shape[0] > u.shape[1] else u
            x = x / (x.norm() + 1e-7)
            for _ in range(cfg.muon_ns_steps):
                gram = x @ x.T
                x = a * x + (b * gram + c * gram @ gram) @ x
            x = x.T if u.shape[0] > u.shape[1] else x
            p.mul_(1 - lr * cfg.muon_lr / cfg.lr * cfg.weight_decay)
            p.sub_(x * (lr * cfg.muon_lr / cfg.lr) * 0.2 * math.sqrt(max(p.shape)))
            p.grad = None
        for group in adam.param_groups:
            group["lr"] = lr
        adam.step()


def test_one_step_equals_the_reference():
    cfg = OptimConfig(name="muon", lr=1e-2, muon_lr=0.05, weight_decay=0.1)
    model_cfg = ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64)
    ours, ref = GPT(model_cfg, seed=3), GPT(model_cfg, seed=3)
    optimizer = make_optimizer(ours, cfg, torch.device("cpu"))
    others = [(n, p) for n, p in ref.named_parameters()
              if not (n.startswith("blocks.") and p.dim() == 2)]
    adam = torch.optim.AdamW([{"params": [p for _, p in others if p.dim() >= 2],
                               "weight_decay": 0.1},
                              {"params": [p for _, p in others if p.dim() < 2],
                               "weight_decay": 0.0}],
                             lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, foreach=False)
    gen, buffers = torch.Generator().manual_seed(1), {}
    for step in range(3):
        grads = {n: torch.randn(p.shape, generator=gen) for n, p in ours.named_parameters()}
        lr, momentum = 1e-2 * (step + 1) / 3, momentum_at(step, cfg)
        for n, p in ours.named_parameters():
            p.grad = grads[n].clone()
        set_lr(optimizer, lr, momentum)
        optimizer.step()
        reference_muon_step(ref, grads, cfg, lr, momentum, buffers, adam)
        for (name, p), q in zip(ours.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=f"step {step} {name}")
    muon_state = [s for s in optimizer.state.values() if "momentum_buffer" in s]
    assert len(muon_state) == 4 * model_cfg.n_layer  # qkv, attention out, MLP in and out


def test_groups_split_matrices_from_the_rest():
    model = GPT(ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64))
    cfg = OptimConfig(name="muon", lr=1e-3, muon_lr=0.02)
    opt = make_muon(model, cfg, None, torch.device("cpu"))
    names = {id(p): n for n, p in model.named_parameters()}
    muon, decay, no_decay = ([names[id(p)] for p in g["params"]] for g in opt.param_groups)
    assert all(n.startswith("blocks.") and "weight" in n and "ln" not in n for n in muon)
    assert len(muon) == 8 and decay == ["wte.weight", "wpe.weight"]
    assert all(model.get_parameter(n).dim() == 1 for n in no_decay)
    set_lr(opt, 5e-4, 0.9)
    assert [g["lr"] for g in opt.param_groups] == [pytest.approx(0.01), 5e-4, 5e-4]
    assert opt.param_groups[0]["momentum"] == 0.9


def test_momentum_warmup_is_a_function_of_the_step():
    cfg = OptimConfig(muon_momentum_start=0.85, muon_momentum=0.95, muon_momentum_warmup=10)
    assert momentum_at(0, cfg) == 0.85
    assert momentum_at(5, cfg) == pytest.approx(0.90)
    assert momentum_at(10, cfg) == momentum_at(1000, cfg) == 0.95
    assert momentum_at(0, OptimConfig(muon_momentum_warmup=0)) == 0.95


@pytest.mark.parametrize("mode", ["zero1", "fsdp2"])
def test_muon_with_a_sharded_mode_is_one_line(mode, tmp_path):
    from ddpgpt.preflight import resolve

    cfg = TrainConfig(optim=OptimConfig(name="muon"), run=RunConfig(sync=mode, device="cpu"))
    dataset = type("Dataset", (), {"vocab_size": 64, "path": tmp_path})()
    with pytest.raises(ConfigError) as e:
        resolve(cfg, dataset, 1)
    assert str(e.value) == (f"optim.name = muon cannot use run.sync = {mode}: it shards matrices "
                            "into slices and Muon orthogonalizes whole ones; use run.sync ddp, "
                            "allreduce or rs-ag")

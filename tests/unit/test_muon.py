"""Muon in one process, against torch's own optimizers and the SVD.

- One step of our optimizer (W=1) against torch.optim.Muon(adjust_lr_fn="match_rms_adamw") on the
  blocks' matrices plus torch.optim.AdamW on the rest: bitwise equal with bf16 Newton-Schulz
  (torch's step itself runs). With fp32 Newton-Schulz (run.precision fp32) the update of each
  matrix is torch's within bf16's rounding: measured 1.1e-2 relative (bf16 keeps 8 bits of
  mantissa through five iterations); we allow 3e-2. AdamW's parameters stay bitwise.
- Our Newton-Schulz (fp32 on CPU) is torch's iteration: in bf16 it is bitwise torch's; in fp32 it
  keeps the singular vectors (Uᵀ·O·V diagonal, off-diagonal below 1e-4) and maps every singular
  value of at least 1/100 of the largest into [0.68, 1.21] (measured [0.6818, 1.2016]).
- Owners (muon.plan) balance the Newton-Schulz cost and give every matrix exactly one owner.
"""

import dataclasses
import math

import pytest
import torch
from torch.optim._muon import _zeropower_via_newtonschulz

from ddpgpt.config.checks import ConfigError
from ddpgpt.config.model import ModelConfig
from ddpgpt.config.optim import OptimConfig
from ddpgpt.distributed.group import DistEnv
from ddpgpt.model.gpt import GPT
from ddpgpt.optim import muon, optimizer
from ddpgpt.optim.muon import (
    NS_COEFFICIENTS,
    NS_NORM_SCALE,
    Matrices,
    Muon,
    newton_schulz,
    ns_cost,
    ns_polynomials,
    plan,
)
from ddpgpt.optim.schedule import momentum_at
from ddpgpt.sync.base import Sync

pytestmark = pytest.mark.usefixtures("one_thread")
BAND = (0.68, 1.21)
COEFFICIENTS = (3.4445, -4.7750, 2.0315)
MODEL = ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64, arch="gpt2")
CFG = OptimConfig(name="muon", lr=1e-2, muon_lr=0.05, weight_decay=0.1)


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


IDS = [n for n, _ in matrices()]


@pytest.mark.parametrize("name, g", list(matrices()), ids=IDS)
def test_newton_schulz_in_bf16_is_torchs(name, g):
    ours = newton_schulz(g, [COEFFICIENTS] * 5, 1e-7, torch.bfloat16)
    assert torch.equal(ours, _zeropower_via_newtonschulz(g, COEFFICIENTS, 5, 1e-7)), name


@pytest.mark.parametrize("name, g", list(matrices()), ids=IDS)
def test_polar_express_keeps_singular_vectors_in_a_tighter_band_than_quintic(name, g):
    """Polar Express's five polynomials, against the SVD: the same singular vectors, and every
    singular value above 1% of the largest lands in [0.859, 1.141] where quintic's land in
    [0.682, 1.202] (measured on these matrices and on 256 × 1024 Gaussians)."""
    polar = newton_schulz(g, ns_polynomials("polar", 5), 1e-7, norm_scale=NS_NORM_SCALE["polar"])
    quintic = newton_schulz(g, [COEFFICIENTS] * 5, 1e-7)
    u, s, vh = torch.linalg.svd(g, full_matrices=False)
    d = u.T @ polar @ vh.T
    values, well = d.diagonal(), s >= s.max() / 100
    assert (d - torch.diag(values)).abs().max() < 1e-4, name
    assert values.max() <= 1.142 and values[well].min() >= 0.858, (name, values[well].min())
    spread = (values[well] - 1).abs().max()
    assert spread < ((u.T @ quintic @ vh.T).diagonal()[well] - 1).abs().max(), name
    if well.all():  # closer to the oracle U·Vᵀ than quintic
        assert (polar - u @ vh).norm() < (quintic - u @ vh).norm(), name


@pytest.mark.parametrize("ns", ["quintic", "polar"])
@pytest.mark.parametrize("shape", [(32, 96), (96, 32)])  # wide, tall: long side 3x the short
@pytest.mark.parametrize("cond", [1.0, 1e2])
def test_the_gram_form_is_the_iteration(monkeypatch, ns, shape, cond):
    """Newton-Schulz on the Gram matrix (fp32 and fp64, long side >= GRAM_RATIO x short): in fp64
    the x-form's result to 1e-12; in fp32 within 3e-5 of it (the x-form in fp32: ~1e-6)."""
    gen = torch.Generator().manual_seed(5)
    m, n = min(shape), max(shape)
    s = torch.logspace(0, -math.log10(cond), m)
    g = orthogonal(m, gen) @ torch.diag(s) @ orthogonal(n, gen)[:m]  # (m, n)
    g = g if shape[0] == m else g.T
    polys, scale = ns_polynomials(ns, 5), NS_NORM_SCALE[ns]
    got = {d: newton_schulz(g, polys, 1e-7, d, scale) for d in (torch.float64, torch.float32)}
    monkeypatch.setattr(muon, "GRAM_RATIO", float("inf"))  # the x-form everywhere
    want = newton_schulz(g, polys, 1e-7, torch.float64, scale)
    x_form32 = newton_schulz(g, polys, 1e-7, torch.float32, scale)
    torch.testing.assert_close(got[torch.float64], want, rtol=0, atol=1e-12)
    torch.testing.assert_close(got[torch.float32].double(), want, rtol=0, atol=3e-5)
    assert (x_form32.double() - want).abs().max() < 3e-6


def test_polar_schedules_are_made_for_their_length():
    table = NS_COEFFICIENTS["polar"]
    assert ns_polynomials("polar", 5) == list(table)
    assert ns_polynomials("polar", 7) == [*table, table[-1], table[-1]]
    with pytest.raises(ValueError, match="polar needs at least 5 steps"):
        ns_polynomials("polar", 4)
    with pytest.raises(ConfigError, match="muon_ns = polar is made for 5 iterations; "
                                          "optim.muon_ns_steps = 3 must be >= 5"):
        OptimConfig(name="muon", muon_ns="polar", muon_ns_steps=3)


@pytest.mark.parametrize("ns, ns_dtype", [("polar", torch.float32), ("polar", torch.bfloat16),
                                          ("quintic", torch.float32)])
def test_a_step_with_another_iteration_is_the_update_of_that_iteration(ns, ns_dtype):
    """Muon's step with `ns` in `ns_dtype` is W·(1 - lr·wd) - lr·scale·NS(Nesterov momentum),
    computed here by hand from the same gradient (first step: the buffer is (1-m)·G)."""
    gen = torch.Generator().manual_seed(3)
    w0, grad = torch.randn(24, 40, generator=gen), torch.randn(24, 40, generator=gen)
    p = torch.nn.Parameter(w0.clone())
    p.grad = grad.clone()
    lr, wd, m = 0.05, 0.1, 0.9
    Muon([p], ns_dtype=ns_dtype, ns=ns, lr=lr, weight_decay=wd, momentum=m,
         adjust_lr_fn="match_rms_adamw").step()
    update = grad.lerp((1 - m) * grad, m)
    polys = ns_polynomials(ns, 5) if ns == "polar" else [COEFFICIENTS] * 5
    ortho = newton_schulz(update, polys, 1e-7, ns_dtype, NS_NORM_SCALE[ns])
    expected = w0 * (1 - lr * wd) - lr * 0.2 * math.sqrt(40) * ortho.float()
    assert torch.allclose(p.detach(), expected, atol=1e-6)


@pytest.mark.parametrize("eq, snap", [(True, False), (False, True), (True, True)])
@pytest.mark.parametrize("ns_dtype", [torch.float32, torch.bfloat16])
def test_muoneq_rows_and_the_norm_snap_reshape_the_update_around_the_iteration(eq, snap,
                                                                               ns_dtype):
    """eq: the Nesterov update's rows divided by their L2 norms before Newton-Schulz; snap: its
    result rescaled to sqrt(min(rows, cols)) in Frobenius norm. By hand from the same gradient,
    with rows of very different scales (what MuonEq-R evens out)."""
    gen = torch.Generator().manual_seed(4)
    w0 = torch.randn(24, 40, generator=gen)
    grad = torch.randn(24, 40, generator=gen) * torch.logspace(-2, 1, 24).unsqueeze(1)
    p = torch.nn.Parameter(w0.clone())
    p.grad = grad.clone()
    lr, wd, m = 0.05, 0.1, 0.9
    Muon([p], ns_dtype=ns_dtype, eq=eq, snap=snap, lr=lr, weight_decay=wd, momentum=m,
         adjust_lr_fn="match_rms_adamw").step()
    update = grad.lerp((1 - m) * grad, m)
    if eq:
        update = update / update.norm(dim=1, keepdim=True)
    ortho = newton_schulz(update, [COEFFICIENTS] * 5, 1e-7, ns_dtype)
    if snap:  # in the iteration's dtype
        ortho = ortho * (math.sqrt(24) / ortho.norm())
    expected = w0 * (1 - lr * wd) - lr * 0.2 * math.sqrt(40) * ortho.float()
    assert torch.allclose(p.detach(), expected, atol=1e-6)
    plain = torch.nn.Parameter(w0.clone())
    plain.grad = grad.clone()
    Muon([plain], ns_dtype=ns_dtype, lr=lr, weight_decay=wd, momentum=m,
         adjust_lr_fn="match_rms_adamw").step()
    assert (plain.detach() - p.detach()).abs().max() > 1e-3  # each changes the step


@pytest.mark.parametrize("name, g", list(matrices()), ids=IDS)
def test_newton_schulz_fp32_keeps_singular_vectors_and_equalizes_values(name, g):
    out = newton_schulz(g, [COEFFICIENTS] * 5, 1e-7)
    u, s, vh = torch.linalg.svd(g, full_matrices=False)
    d = u.T @ out @ vh.T  # diag(f(S)) if the singular vectors are kept
    values = d.diagonal()
    assert (d - torch.diag(values)).abs().max() < 1e-4, name
    assert (values > 0).all() and values.max() <= BAND[1], name
    well = values[s >= s.max() / 100]
    assert well.min() >= BAND[0], (name, well.min())
    if s.min() >= s.max() / 100:  # the oracle U·Vᵀ, reached to within the band
        assert (out - u @ vh).norm() / (u @ vh).norm() < 1 - BAND[0]


def ours_and_torchs(ns_dtype: torch.dtype):
    """Our optimizer at W=1 and torch's two over a copy of the same model."""
    ours, ref = GPT(MODEL, seed=3), GPT(MODEL, seed=3)
    groups = optimizer.groups(ours, CFG)
    opt = optimizer.Optimizer(groups, Sync(ours, groups, DistEnv()).params(), CFG,
                              torch.device("cpu"), ns_dtype=ns_dtype)
    named = list(ref.named_parameters())
    matrices = [p for n, p in named if optimizer.is_muon_param(n, p)]
    rest = [p for n, p in named if not optimizer.is_muon_param(n, p)]
    muon = torch.optim.Muon(matrices, lr=CFG.muon_lr, weight_decay=CFG.weight_decay,
                            adjust_lr_fn="match_rms_adamw")
    adamw = torch.optim.AdamW([{"params": [p for p in rest if p.dim() >= 2],
                                "weight_decay": CFG.weight_decay},
                               {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0}],
                              lr=CFG.lr, betas=(CFG.beta1, CFG.beta2), eps=CFG.eps,
                              fused="cpu" in optimizer.fused_devices() or None)  # ours' kernel
    return ours, opt, ref, muon, adamw


def step_both(ours, opt, ref, muon, adamw, gen, step):
    lr, momentum = CFG.lr * (step + 1) / 3, momentum_at(step, CFG)
    for p, q in zip(ours.parameters(), ref.parameters()):
        p.grad = torch.randn(p.shape, generator=gen)
        q.grad = p.grad.clone()
    optimizer.set_lr(opt, lr, momentum)
    opt.step()
    for group in muon.param_groups:
        group["lr"], group["momentum"] = lr * CFG.muon_lr / CFG.lr, momentum
    for group in adamw.param_groups:
        group["lr"] = lr
    muon.step()
    adamw.step()


def test_a_step_is_torchs_muon_and_adamw_bitwise_in_bf16():
    ours, opt, ref, muon, adamw = ours_and_torchs(torch.bfloat16)
    gen = torch.Generator().manual_seed(1)
    for step in range(3):
        step_both(ours, opt, ref, muon, adamw, gen, step)
        for (name, p), q in zip(ours.named_parameters(), ref.parameters()):
            assert torch.equal(p, q), (step, name)
    # the same momentum buffers, in torch's Muon state_dict layout over the whole model
    full, theirs = Sync(ours, optimizer.groups(ours, CFG), DistEnv()).optimizer_state(opt), \
        muon.state_dict()
    assert full["muon"]["state"].keys() == theirs["state"].keys()
    assert all(torch.equal(s["momentum_buffer"], theirs["state"][i]["momentum_buffer"])
               for i, s in full["muon"]["state"].items())
    assert full["muon"]["param_groups"][0]["params"] == theirs["param_groups"][0]["params"]
    assert full["adamw"]["state"].keys() == adamw.state_dict()["state"].keys()


def test_a_step_with_fp32_newton_schulz_is_torchs_within_bf16_rounding():
    ours, opt, ref, muon, adamw = ours_and_torchs(torch.float32)
    before = [p.detach().clone() for p in ours.parameters()]
    step_both(ours, opt, ref, muon, adamw, torch.Generator().manual_seed(1), 0)
    worst = 0.0
    for (name, p), q, p0 in zip(ours.named_parameters(), ref.parameters(), before):
        if optimizer.is_muon_param(name, p):
            worst = max(worst, ((p - q).norm() / (q - p0).norm()).item())
        else:
            assert torch.equal(p, q), name
    assert 0 < worst < 3e-2


def test_owners_balance_the_cost_one_owner_each():
    shapes = [(96, 32), (32, 32), (128, 32), (32, 128)] * 3  # 3 blocks: qkv, proj, fc, mlp proj
    for world in (1, 2, 3, 4, 5, 8, 16):
        layout = plan(shapes, world)
        owner = layout.owner
        assert sorted(i for r in range(world) for i in layout.owned(r)) == list(range(12))
        assert all(owner[i] == r for r in range(world) for i in layout.owned(r))
        assert layout == plan(shapes, world)  # a function of the shapes and W
        largest = max(ns_cost(s) for s in shapes)
        mean = sum(ns_cost(s) for s in shapes) / world
        assert max(layout.loads()) <= mean + largest  # greedy's bound
    # 6 matrices of one class at W=2, 3 or 6: rounds, perfectly balanced, no padding
    for world in (2, 3, 6):
        layout = plan([(128, 32), (32, 128)] * 3, world)
        assert layout.balance() == 1.0 and layout.padded() == 6 * 128 * 32
    # the costliest leftovers first, each to the least loaded rank
    assert plan([(64, 64), (32, 32), (48, 48)], 2).owner == [0, 1, 1]


def test_rounds_merge_into_buckets_of_bucket_elems():
    shapes = [(32, 32)] * 8
    assert [len(b[0]) for b in plan(shapes, 2).buckets] == [1, 1, 1, 1]
    assert [len(b[0]) for b in plan(shapes, 2, bucket_elems=4 * 1024).buckets] == [2, 2]
    # the last layer's matrices first: the backward finishes them first
    assert plan(shapes, 2).buckets[0] == ((7,), (6,))


def test_gpt2_124m_loads():
    """The README's figures: max/mean Newton-Schulz cost per rank for gpt2-124m's 48 matrices."""
    with torch.device("meta"):
        model = GPT(ModelConfig(n_layer=12, n_head=12, n_embd=768, vocab_size=50304, arch="gpt2"))
    shapes = [tuple(p.shape) for n, p in model.named_parameters() if optimizer.is_muon_param(n, p)]
    assert len(shapes) == 48
    balance = {w: plan(shapes, w).balance() for w in (2, 4, 8)}
    assert balance[2] == balance[4] == 1.0
    assert balance[8] == pytest.approx(1.0556, abs=1e-4)


def test_the_whole_model_state_survives_a_round_trip():
    ours, opt, ref, muon, adamw = ours_and_torchs(torch.float32)
    step_both(ours, opt, ref, muon, adamw, torch.Generator().manual_seed(1), 0)
    sync = Sync(ours, optimizer.groups(ours, CFG), DistEnv())
    full = sync.optimizer_state(opt)
    other = GPT(MODEL, seed=3)
    groups = optimizer.groups(other, CFG)
    fresh = optimizer.Optimizer(groups, Sync(other, groups, DistEnv()).params(), CFG,
                                torch.device("cpu"), ns_dtype=torch.float32)
    Sync(other, groups, DistEnv()).load_optimizer_state(fresh, full)
    again = Sync(other, groups, DistEnv()).optimizer_state(fresh)
    for part in ("muon", "adamw"):
        for i, s in full[part]["state"].items():
            assert all(torch.equal(v, again[part]["state"][i][k]) for k, v in s.items())


def test_an_earlier_muon_checkpoint_is_read_in_todays_layout():
    """One optimizer with groups muon, decay, no_decay, numbered across all three."""
    state = {"state": {0: {"momentum_buffer": torch.ones(2, 2)},
                       2: {"step": torch.tensor(3.0), "exp_avg": torch.zeros(4),
                           "exp_avg_sq": torch.zeros(4)}},
             "param_groups": [{"kind": "muon", "params": [0, 1]}, {"params": [2]},
                              {"params": [3, 4]}]}
    new = optimizer.upgrade(state)
    assert new["muon"]["state"] == {0: state["state"][0]}
    assert new["muon"]["param_groups"][0]["params"] == [0, 1]
    assert new["adamw"]["state"] == {0: state["state"][2]}
    assert [g["params"] for g in new["adamw"]["param_groups"]] == [[0], [1, 2]]
    assert optimizer.upgrade(new) is new and optimizer.upgrade(new["adamw"]) is new["adamw"]


def test_groups_split_matrices_from_the_rest():
    model = GPT(MODEL)
    names = {id(p): n for n, p in model.named_parameters()}
    muon, decay, no_decay = ([names[id(p)] for p in g.params] for g in optimizer.groups(model, CFG))
    assert all(n.startswith("blocks.") and "weight" in n and "ln" not in n for n in muon)
    assert len(muon) == 8 and decay == ["wte.weight", "wpe.weight"]
    assert all(model.get_parameter(n).dim() == 1 for n in no_decay)
    groups = optimizer.groups(model, CFG)
    opt = optimizer.Optimizer(groups, Sync(model, groups, DistEnv()).params(), CFG,
                              torch.device("cpu"))
    optimizer.set_lr(opt, 5e-3, 0.9)
    assert [g["lr"] for g in opt.param_groups] == [pytest.approx(0.025), 5e-3, 5e-3]
    assert opt.param_groups[0]["momentum"] == 0.9


def test_the_modern_arch_gives_muon_the_blocks_matrices_and_adamw_the_rest():
    """The untied head and the embedding are AdamW's (decayed), the QK-norm and RMSNorm gains
    AdamW's (not decayed); Muon owns the five matrices of each block (qkv, attention out, the
    SwiGLU's gate, up and down) and nothing else."""
    model = GPT(dataclasses.replace(MODEL, arch="modern"))
    names = {id(p): n for n, p in model.named_parameters()}
    muon, decay, no_decay = ([names[id(p)] for p in g.params] for g in optimizer.groups(model, CFG))
    parts = ("attn.qkv", "attn.proj", "mlp.gate", "mlp.fc", "mlp.proj")
    assert muon == [f"blocks.{i}.{part}.weight" for i in range(2) for part in parts]
    assert decay == ["wte.weight", "lm_head.weight"]
    assert no_decay == [n for n, _ in model.named_parameters() if n not in muon + decay]
    assert {n.rsplit(".", 2)[-2] for n in no_decay} == {"ln1", "q_norm", "k_norm", "ln2", "ln_f"}
    assert sorted(muon + decay + no_decay) == sorted(names.values())


def test_matrices_gather_at_one_rank_is_every_matrix_in_model_order():
    params = [torch.nn.Parameter(torch.full((3, 2), float(i))) for i in range(4)]
    matrices = Matrices(params, DistEnv())
    out = matrices.gather([params[i] for i in matrices.mine])
    assert all(torch.equal(o, p) for o, p in zip(out, params))
    assert matrices.gather(None) == [None] * 4


def test_momentum_warmup_is_a_function_of_the_step():
    cfg = OptimConfig(muon_momentum_start=0.85, muon_momentum=0.95, muon_momentum_warmup=10)
    assert momentum_at(0, cfg) == 0.85
    assert momentum_at(5, cfg) == pytest.approx(0.90)
    assert momentum_at(10, cfg) == momentum_at(1000, cfg) == 0.95
    assert momentum_at(0, OptimConfig(muon_momentum_warmup=0)) == 0.95

"""Parameter groups and the optimizer against torch.optim.AdamW built by hand. (Muon's groups and
step: test_muon.py; the learning-rate schedules: test_schedule.py.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from ddpgpt.config.model import ModelConfig
from ddpgpt.config.optim import OptimConfig
from ddpgpt.distributed.group import DistEnv
from ddpgpt.errors import UserError
from ddpgpt.model.gpt import GPT
from ddpgpt.optim.optimizer import Optimizer, check_groups, fused_devices, groups, set_lr
from ddpgpt.optim.schedule import lr_at
from ddpgpt.sync.base import Sync
from tests.helpers import SMALL

pytestmark = pytest.mark.usefixtures("one_thread")


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """optim.groups as torch's group dicts."""
    return [{"params": g.params, "weight_decay": g.weight_decay}
            for g in groups(model, OptimConfig(weight_decay=weight_decay))]


def make_optimizer(model: nn.Module, cfg: OptimConfig) -> Optimizer:
    """As the Trainer builds it at world size 1."""
    parts = groups(model, cfg)
    return Optimizer(parts, Sync(model, parts, DistEnv()).params(), cfg, torch.device("cpu"))


def _decayed_by_module(model: nn.Module) -> set[int]:
    """The oracle: weights of Linear and Embedding modules decay, nothing else does."""
    return {id(m.weight) for m in model.modules() if isinstance(m, (nn.Linear, nn.Embedding))}


# ---- parameter groups ------------------------------------------------------------------------

@pytest.mark.parametrize("bias", [True, False])
def test_param_groups(bias):
    model = GPT(ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64,
                            bias=bias, arch="gpt2"))
    decay, no_decay = param_groups(model, 0.25)
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.25, 0.0)
    assert {id(p) for p in decay["params"]} == _decayed_by_module(model)
    everything = [id(p) for p in model.parameters()]
    grouped = [id(p) for p in decay["params"] + no_decay["params"]]
    assert sorted(grouped) == sorted(everything)  # each parameter exactly once
    names = {id(p): n for n, p in model.named_parameters()}
    expected_no_decay = {n for n in names.values()
                         if ".ln" in n or n.startswith("ln_f") or n.endswith(".bias")}
    assert {names[id(p)] for p in no_decay["params"]} == expected_no_decay
    L = 2  # LayerNorm gains (2 per block + ln_f), and with bias: LayerNorm biases + 4 linear
           # biases per block
    assert len(no_decay["params"]) == (2 * L + 1) * (2 if bias else 1) + (4 * L if bias else 0)


def test_param_groups_skip_frozen_parameters():
    model = GPT(SMALL)
    model.wpe.weight.requires_grad_(False)
    model.ln_f.bias.requires_grad_(False)
    decay, no_decay = param_groups(model, 0.1)
    grouped = {id(p) for p in decay["params"] + no_decay["params"]}
    assert grouped == {id(p) for p in model.parameters() if p.requires_grad}
    assert len(grouped) == len(list(model.parameters())) - 2


@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_embed_lr_steps_the_embedding_alone_and_a_checkpoint_moves_into_its_group(name):
    """optim.embed_lr: the token embedding in a third AdamW group, decayed, at embed_lr / lr of
    the schedule's lr. A checkpoint written without it (tensors by name, as format 3) resumes
    into the new layout with the embedding's moments and step count where they were."""
    plain = OptimConfig(name=name, lr=1e-2, min_lr=1e-3)
    split = OptimConfig(name=name, lr=1e-2, min_lr=1e-3, embed_lr=5e-2)
    model = GPT(SMALL)
    names = {id(p): n for n, p in model.named_parameters()}
    parts = groups(model, split)
    assert [[names[id(p)] for p in g.params] for g in parts[-1:]] == [["wte.weight"]]
    assert (parts[-1].lr_scale, parts[-1].weight_decay) == (5.0, split.weight_decay)
    assert sum(len(g.params) for g in parts) == len(names)  # each parameter exactly once
    before, saver = make_optimizer(model, plain), Sync(model, groups(model, plain), DistEnv())
    for step in range(2):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(step))
        set_lr(before, 1e-2)
        before.step()
    written, _ = saver.checkpoint_state(before)
    after, loader = make_optimizer(model, split), Sync(model, parts, DistEnv())
    targets, _ = loader.checkpoint_state(after, ("adamw", "muon"))
    assert targets.keys() == written.keys()
    for key, held in written.items():  # what checkpoint/read.py's read_into does
        targets[key].chunks[0][1].copy_(held.chunks[0][1])
    loader.set_adamw_steps(after, saver.adamw_steps(before))
    set_lr(after, 2e-3)
    embedding = next(g for g in after.adamw.param_groups if g["lr_scale"] == 5.0)
    assert embedding["params"] == [model.wte.weight] and embedding["lr"] == pytest.approx(1e-2)
    old, new = before.adamw.state[model.wte.weight], after.adamw.state[model.wte.weight]
    assert all(torch.equal(old[k], new[k]) for k in ("exp_avg", "exp_avg_sq", "step"))
    # A format 1-2 checkpoint holds torch's state_dict, numbered through the groups: refused in
    # one line where torch's load_state_dict would raise its own error; the same groups load.
    whole = saver.optimizer_state(before)
    with pytest.raises(UserError) as e:
        check_groups(after, whole, "checkpoint c")
    assert str(e.value) == (
        "checkpoint c: its AdamW state has 2 parameter groups, this run's 3: optim.embed_lr, set "
        "or unset since, moves the token embedding into a group of its own or back, which a "
        "checkpoint of format 1-2 cannot follow; resume with the optim.embed_lr in its "
        "meta.json, and change it from the next checkpoint on (format 3 follows it)")
    check_groups(make_optimizer(model, plain), whole, "checkpoint c")


# ---- the optimizer against torch.optim.AdamW --------------------------------------------------

def test_make_optimizer_matches_adamw_by_hand():
    cfg = OptimConfig(lr=3e-3, min_lr=3e-4, warmup_steps=2, weight_decay=0.2, beta1=0.8,
                      beta2=0.9, eps=1e-6)
    ours, ref = GPT(SMALL, seed=1), GPT(SMALL, seed=1)
    opt = make_optimizer(ours, cfg)
    decay = [p for p in ref.parameters() if id(p) in _decayed_by_module(ref)]
    no_decay = [p for p in ref.parameters() if id(p) not in _decayed_by_module(ref)]
    ref_opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.2},
                                 {"params": no_decay, "weight_decay": 0.0}],
                                lr=3e-3, betas=(0.8, 0.9), eps=1e-6,
                                fused="cpu" in fused_devices() or None)  # ours' kernel
    assert [(g["lr"], g["betas"], g["eps"], g["weight_decay"]) for g in opt.param_groups] == \
        [(3e-3, (0.8, 0.9), 1e-6, 0.2), (3e-3, (0.8, 0.9), 1e-6, 0.0)]
    gen = torch.Generator().manual_seed(0)
    steps = 4
    for step in range(steps):
        idx, targets = (torch.randint(0, SMALL.vocab_size, (2, 12), generator=gen)
                        for _ in range(2))
        lr = lr_at(step, cfg, steps)
        for model, optimizer in ((ours, opt), (ref, ref_opt)):
            model(idx, targets)[1].backward()
            if optimizer is opt:
                set_lr(optimizer, lr)
            else:
                for group in optimizer.param_groups:
                    group["lr"] = lr
            optimizer.step()
            optimizer.zero_grad()
    ours_state, ref_state = ours.state_dict(), ref.state_dict()
    assert all(torch.equal(ours_state[k], ref_state[k]) for k in ref_state)
    assert not torch.equal(ours_state["wte.weight"], GPT(SMALL, seed=1).state_dict()["wte.weight"])


def test_set_lr_sets_every_group():
    opt = make_optimizer(GPT(SMALL), OptimConfig())
    set_lr(opt, 0.125)
    assert [g["lr"] for g in opt.param_groups] == [0.125, 0.125]

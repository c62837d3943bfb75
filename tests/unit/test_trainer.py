"""The Trainer in one process: its state round trip, and the skip path with a loss scaler."""

from __future__ import annotations

import copy

import pytest
import torch

from ddpgpt.config.io import build
from ddpgpt.distributed.group import DistEnv
from ddpgpt.guard.health import Guard, StopSignal
from ddpgpt.optim.schedule import Rates
from ddpgpt.run.preflight import preflight
from ddpgpt.trainer import Trainer

LR = Rates(1e-3, 0.95)  # every update here: lr 1e-3, Muon momentum 0.95


def make(tiny_data, tmp_path, optim: dict | None = None, model: dict | None = None,
         **run) -> Trainer:
    flags = {"model": {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 32, **(model or {})},
             "data": {"dir": str(tiny_data), "micro_batch": 2, "global_batch": 4,
                      "eval_windows": 4},
             "optim": optim or {},
             "run": {"dir": str(tmp_path / "run"), "device": "cpu", "threads": 1, **run}}
    cfg, dataset = preflight(build(None, None, flags), 1, 1)
    env = DistEnv()
    return Trainer(cfg, env, dataset, Guard(env, cfg.run, StopSignal(announce=False)))


def test_skipped_step_with_a_loss_scaler_lets_the_next_step_run(tiny_data, tmp_path, one_thread):
    """fp16's GradScaler, a step skipped for a NaN loss: the skip must close the scaler's step
    (update()), or the next step's unscale_() raises "unscale_() has already been called on
    this optimizer since the last update()". (CPU GradScaler: same state machine as CUDA's.)"""
    trainer = make(tiny_data, tmp_path)
    trainer.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    trainer.train_step()
    trainer.skip_update()  # the guard saw a non-finite loss on some rank
    trainer.train_step()   # raised before the fix
    trainer.update(LR)
    steps = {int(s["step"]) for s in trainer.optimizer.state_dict()["state"].values()}
    assert steps == {1}  # one update: the skipped step made none
    assert all(p.grad is None for p in trainer.raw.parameters())


def test_state_dict_round_trip(tiny_data, tmp_path, one_thread):
    """3 steps, state saved; a fresh trainer loaded from it takes the same 4th step, bitwise."""
    first = make(tiny_data, tmp_path)
    for _ in range(3):
        first.train_step()
        first.update(LR)
        first.step += 1
    state = copy.deepcopy(first.state_dict())  # as from disk: no tensor shared with `first`
    second = make(tiny_data, tmp_path)
    second.load_state_dict(state, saved_world_size=1)
    assert second.step == 3 and second.loader.state_dict() == first.loader.state_dict()
    losses = []
    for trainer in (first, second):
        loss, _ = trainer.train_step()
        trainer.update(LR)
        losses.append(loss)
    assert torch.equal(losses[0], losses[1])
    for a, b in zip(first.raw.parameters(), second.raw.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("saved_world_size", [1, 2])
def test_rng_carries_over_only_at_the_same_world_size(tiny_data, tmp_path, one_thread,
                                                      saved_world_size):
    first = make(tiny_data, tmp_path)
    torch.rand(5)  # move the stream on
    state = first.state_dict()
    expected = torch.rand(3)
    second = make(tiny_data, tmp_path)
    second.load_state_dict(state, saved_world_size=saved_world_size)
    assert torch.equal(torch.rand(3), expected) == (saved_world_size == 1)


def entries(state: dict) -> dict:
    """The per-parameter entries of an optimizer state, AdamW's or Muon's and AdamW's, by index."""
    parts = {k: state[k] for k in ("muon", "adamw")} if "muon" in state else {"adamw": state}
    return {(name, i): entry for name, part in parts.items()
            for i, entry in part["state"].items()}


def hyperparameters(trainer: Trainer) -> list[dict]:
    return [{k: v for k, v in g.items() if k not in ("params", "lr")}
            for g in trainer.optimizer.param_groups]


@pytest.mark.parametrize("optim, changed", [
    ({"name": "adamw"}, {"weight_decay": 5.0, "beta1": 0.5, "eps": 1e-3}),
    ({"name": "muon"}, {"muon_lr": 0.2, "muon_ns_steps": 1, "weight_decay": 5.0}),
], ids=["adamw", "muon"])
def test_settings_changed_on_resume_are_applied(tiny_data, tmp_path, one_thread, optim,
                                                changed):
    """The saved param_groups used to overwrite the config: a resume with another weight decay,
    beta1 or Muon lr trained bitwise like the unchanged resume while config.json said otherwise.
    Now the optimizer keeps its state (moments, momentum buffers, step counts) and takes its
    hyperparameters from this run's config."""
    first = make(tiny_data, tmp_path, optim)
    for _ in range(2):
        first.train_step()
        first.update(LR)
        first.step += 1
    state = copy.deepcopy(first.state_dict())
    resumed = {}
    for name, settings in (("same", optim), ("changed", {**optim, **changed})):
        trainer = make(tiny_data, tmp_path, settings)
        fresh = hyperparameters(trainer)  # what this config builds
        trainer.load_state_dict(copy.deepcopy(state), saved_world_size=1)
        assert hyperparameters(trainer) == fresh, name
        saved, live = entries(state["optimizer"]), entries(trainer.optimizer.state_dict())
        assert saved.keys() == live.keys(), name
        for key, entry in saved.items():
            assert all(torch.equal(entry[k], live[key][k]) for k in entry), (name, key)
        trainer.train_step()
        trainer.update(LR)
        resumed[name] = torch.cat([p.detach().flatten() for p in trainer.raw.parameters()])
    assert (resumed["same"] - resumed["changed"]).abs().max() > 1e-4  # the change took effect


def test_a_checkpoint_without_one_of_the_models_tensors_is_refused(tiny_data, tmp_path,
                                                                   one_thread, monkeypatch):
    """A format-3 checkpoint whose index lacks a tensor this model has (its files and hashes
    consistent: not written by ddpgpt for this model) is refused in one line, where the tensor
    would have kept its fresh initialization."""
    from ddpgpt.checkpoint import read, store
    from ddpgpt.checkpoint.saver import Saver

    first = make(tiny_data, tmp_path)
    first.train_step()
    first.update(LR)
    first.step += 1
    saver = Saver(first.env, tmp_path / "run" / "checkpoints", None, "t", keep=2)
    held, replicated, rest = first.shard_state()
    saver.save(1, held, replicated, rest, {}, wait=True)
    saver.close()
    path = store.step_dir(tmp_path / "run" / "checkpoints", 1)
    meta = store.read_meta(path)
    real_open = read.open_sharded

    def without_wte(path, meta, rest=True):
        index, rest_state = real_open(path, meta, rest)
        del index.state_dict_metadata["model.wte.weight"]
        return index, rest_state

    monkeypatch.setattr(read, "open_sharded", without_wte)
    with pytest.raises(store.CheckpointError) as e:
        make(tiny_data, tmp_path).restore(path, meta)
    assert str(e.value) == (f"{path}: the checkpoint holds no model.wte.weight; it was not "
                            "written by this model and optimizer: resume from another one, or "
                            "--reset")


def test_the_first_step_says_when_it_waits_for_flexattentions_kernel(tiny_data, tmp_path):
    """model.attention flex on a CPU compiles FlexAttention's kernel at the first step (~30 s on
    a new 2-core machine): the run says so before it, as it does for run.compile."""
    flex = make(tiny_data, tmp_path, model={"attention": "flex", "kernels": "eager"})
    assert flex.first_step_waits() == (
        "ddpgpt: the first step waits for FlexAttention's kernel (model.attention flex: tens of "
        "seconds); the compiled kernels are cached for later runs")
    assert make(tiny_data, tmp_path, model={"attention": "sdpa", "kernels": "eager"}
                ).first_step_waits() == ""

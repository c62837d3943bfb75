"""Functions that tests run on every rank: `python -m tests.dist.workers NAME ARGS_JSON OUT_JSON`
(and the same for workers_sync.py: the sync modes and Muon; workers_checkpoint.py: the saver).

Each runs inside `dist.session(device="cpu")` with the environment the test set (RANK, ...);
rank 0 writes the function's result as JSON to OUT_JSON.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from ddpgpt.distributed import collectives
from ddpgpt.distributed.group import session


def eval_loss(env, data: str, max_windows: int) -> float:
    """evaluate() of a seeded tiny model, with the val windows split across the ranks."""
    from ddpgpt.config.model import ModelConfig
    from ddpgpt.data.loader import EvalLoader
    from ddpgpt.data.shards import TokenDataset
    from ddpgpt.evals.loss import evaluate
    from ddpgpt.model.gpt import GPT

    model = GPT(ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=32, vocab_size=320), seed=5)
    loader = EvalLoader(TokenDataset(data), seq_len=32, micro_batch=3, world_size=env.world_size,
                        rank=env.rank, max_windows=max_windows)
    return evaluate(model, loader, env)


def eval_losses(env, data: str, max_windows: list[int]) -> list[float]:
    """eval_loss for each of `max_windows`, one after another in one process group."""
    return [eval_loss(env, data, m) for m in max_windows]


def core_model(block: int, seed: int):
    from ddpgpt.config.model import ModelConfig
    from ddpgpt.model.gpt import GPT

    return GPT(ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=block, vocab_size=257),
               seed=seed).eval()


def core_scores(env, bundle: str, block: int, seed: int) -> dict:
    """A seeded tiny model's CORE scores of `bundle` (each rank its share), without the seconds,
    and how many all-reduces scoring it took on this rank."""
    from ddpgpt.data.tokenizer import ByteTokenizer
    from ddpgpt.evals import tasks
    from ddpgpt.evals.scorer import Scorer

    model = core_model(block, seed)
    scorer = Scorer([tasks.load("core", bundle)], ByteTokenizer(), block, env)
    calls, reduce = [], collectives.all_reduce

    def counted(*args, **kwargs):
        calls.append(1)
        return reduce(*args, **kwargs)

    collectives.all_reduce = counted
    try:
        scores = scorer.score(model)
    finally:
        collectives.all_reduce = reduce
    return {"scores": {k: v for k, v in scores.items() if not k.endswith("_s")},
            "all_reduces": len(calls)}


def count_allreduces(env, data: str, run_dir: str, accum: int, steps: int) -> dict:
    """Runs train_step `steps` times with A = `accum`; returns the DDP buckets all-reduced in each
    step, by index (DDP re-buckets after its first iteration, so the count can change once)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from ddpgpt.config.io import build
    from ddpgpt.guard.health import Guard, StopSignal
    from ddpgpt.run.preflight import preflight
    from ddpgpt.trainer import Trainer

    overrides = {"model": {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 32},
                 "data": {"dir": data, "micro_batch": 2,
                          "global_batch": 2 * env.world_size * accum},
                 "run": {"dir": run_dir, "device": "cpu", "bucket_mb": 0.01}}
    cfg, dataset = preflight(build(None, None, overrides), env.world_size, env.local_world_size)
    t = Trainer(cfg, env, dataset, Guard(env, cfg.run, StopSignal()))
    calls = []

    def hook(state, bucket):
        calls.append(bucket.index())
        return default_hooks.allreduce_hook(None, bucket)

    t.sync.model.register_comm_hook(None, hook)
    per_step = []
    for _ in range(steps):
        calls.clear()
        t.train_step()
        per_step.append(list(calls))
        grads = torch.cat([p.grad.flatten() for p in t.raw.parameters()])
        digest = collectives.digest(grads.numpy().tobytes())
        digests = collectives.all_gather(env, torch.tensor(list(digest), dtype=torch.uint8))
        assert all(torch.equal(d, digests[0]) for d in digests), \
            "ranks hold different gradients after the step"
        t.sync.zero_grad()
    t.close()  # no DDP wrapper may outlive the process group
    return per_step


def early_checkpoint(env, data: str, run_dir: str, steps: int, modes: list[list[str]]) -> dict:
    """For each (sync mode, optimizer): the state a checkpoint takes before the first update
    (what a save after a skipped non-finite first step holds), whether taking it left the live
    optimizer untouched, and the losses of `steps` steps trained on after it; and a resume of
    that state under the same mode with other hyperparameters: the ones the wrapped optimizer
    then steps with. Plus ddp's losses with no early checkpoint, the reference."""
    import copy

    from ddpgpt.config.io import build
    from ddpgpt.guard.health import Guard, StopSignal
    from ddpgpt.optim.schedule import Schedule
    from ddpgpt.run.preflight import preflight
    from ddpgpt.trainer import Trainer

    changed = {"weight_decay": 0.7, "beta1": 0.6, "eps": 1e-6, "muon_ns_steps": 2}

    def trainer(mode, optimizer, **optim):
        flags = {"model": {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 32},
                 "data": {"dir": data, "micro_batch": 2, "global_batch": 8},
                 "optim": {"name": optimizer, "lr": 1e-2, "warmup_steps": 2, **optim},
                 "run": {"dir": run_dir, "device": "cpu", "threads": 1, "sync": mode,
                         "bucket_mb": 0.01}}
        cfg, dataset = preflight(build(None, None, flags), env.world_size, env.local_world_size)
        t = Trainer(cfg, env, dataset, Guard(env, cfg.run, StopSignal(announce=False)))
        return t

    def train(t):
        losses = []
        for k in range(steps):
            loss, _ = t.train_step()
            summed = collectives.all_reduce(env, loss.detach().clone())
            losses.append((summed / env.world_size).item())
            t.update(Schedule(t.cfg.optim, steps).at(k))
        return losses

    out = {}
    for optimizer in ("adamw", "muon"):
        reference = trainer("ddp", optimizer)
        out[f"reference {optimizer}"] = train(reference)
        reference.close()
    for mode, optimizer in modes:
        t = trainer(mode, optimizer)
        state = copy.deepcopy(t.state_dict())  # collective, before any update
        untouched = not t.optimizer.state
        losses = train(t)
        t.close()
        resumed = trainer(mode, optimizer, **changed)
        resumed.load_state_dict(state, saved_world_size=env.world_size)
        groups = [{k: g[k] for k in ("kind", "weight_decay", "betas", "eps", "ns_steps")
                   if k in g} for g in resumed.optimizer.param_groups]
        resumed.close()
        saved = state["optimizer"]
        parts = [saved["muon"], saved["adamw"]] if optimizer == "muon" else [saved]
        out[f"{mode} {optimizer}"] = {"saved_entries": sum(len(p["state"]) for p in parts),
                                      "untouched": untouched, "losses": losses,
                                      "resumed_groups": groups}
    return out


def fail_on_main(env) -> list:
    """Rank 0 hits bad input in `together`: every rank's (exit code, quiet) as it stops."""
    from ddpgpt.errors import UserError

    def bad():
        raise UserError("bad input on rank 0")

    try:
        collectives.together(env, bad, main_only=True)
        got = None
    except UserError as e:
        got = [e.exit_code, e.quiet]
    return [json.loads(t) for t in collectives.all_gather_text(env, json.dumps(got))]


def make_trainer(env, flags: dict):
    from ddpgpt.config.io import build
    from ddpgpt.guard.health import Guard, StopSignal
    from ddpgpt.run.preflight import preflight
    from ddpgpt.trainer import Trainer

    cfg, dataset = preflight(build(None, None, flags), env.world_size, env.local_world_size)
    return Trainer(cfg, env, dataset, Guard(env, cfg.run, StopSignal(announce=False)))


def main(functions: dict | None = None) -> None:
    """Runs `functions[NAME]` (this module's by default) on this rank.

    A rank whose function returned ends with os._exit(0) once the group is destroyed and its
    output flushed: the interpreter's teardown after that is torch's and gloo's, not what these
    tests measure, and it aborted once in CI (a rank's exit -6, "terminate called without an
    active exception", after every rank had finished; not seen again in 280 exits of the same
    launch here). `python -m ddpgpt` exits normally, and the end-to-end tests run it."""
    name, args, out = sys.argv[1], json.loads(sys.argv[2]), Path(sys.argv[3])
    with session(device="cpu", group_at_one=args.pop("group_at_one", False)) as env:
        result = (functions or globals())[name](env, **args)
        if env.is_main:
            out.write_text(json.dumps(result))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)



if __name__ == "__main__":
    main()

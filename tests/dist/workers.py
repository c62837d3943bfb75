"""Functions that tests run on every rank: `python -m tests.dist.workers NAME ARGS_JSON OUT_JSON`.

Each runs inside `dist.session(device="cpu")` with the environment the test set (RANK, ...);
rank 0 writes the function's result as JSON to OUT_JSON.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from ddpgpt import dist


def eval_loss(env, data: str, max_windows: int) -> float:
    """evaluate() of a seeded tiny model, with the val windows split across the ranks."""
    from ddpgpt.config import ModelConfig
    from ddpgpt.data.loader import EvalLoader
    from ddpgpt.data.shards import TokenDataset
    from ddpgpt.evaluate import evaluate
    from ddpgpt.model import GPT

    model = GPT(ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=32, vocab_size=320), seed=5)
    loader = EvalLoader(TokenDataset(data), seq_len=32, micro_batch=3, world_size=env.world_size,
                        rank=env.rank, max_windows=max_windows)
    return evaluate(model, loader, env)


def count_allreduces(env, data: str, run_dir: str, accum: int, steps: int) -> dict:
    """Runs train_step `steps` times with A = `accum`; returns the DDP buckets all-reduced in each
    step, by index (DDP re-buckets after its first iteration, so the count can change once)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from ddpgpt.config_io import build
    from ddpgpt.preflight import preflight
    from ddpgpt.reliability import Guard, StopSignal
    from ddpgpt.train import Trainer

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
        digests = dist.all_gather(env, torch.tensor(list(dist.digest(grads.numpy().tobytes())),
                                                    dtype=torch.uint8))
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

    from ddpgpt.config_io import build
    from ddpgpt.optim import lr_at
    from ddpgpt.preflight import preflight
    from ddpgpt.reliability import Guard, StopSignal
    from ddpgpt.train import Trainer

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
            losses.append((dist.all_reduce(env, loss.detach().clone()) / env.world_size).item())
            t.update(lr_at(k, t.cfg.optim, steps))
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


def muon_modes(env, data: str, run_dir: str, steps: int, modes: list[str],
               chain: dict | None = None) -> dict:
    """`steps` Muon steps of a 30-wide model (G = 12 sequences of 32 tokens, b = 1, so every W
    from 1 to 4 divides it; 30 rows split unevenly over 4 fsdp2 shards) under each mode from the
    same init. Per mode: the global losses; each rank's Newton-Schulz calls per step (torch's, at
    the one place torch.optim.Muon calls it); the matrices whose momentum each rank holds, and
    the ones it steps; Muon's and AdamW's state elements per rank; whether every rank ends with
    the same weights. `chain` ({mode, first, last, load, save}): steps first..last under `mode`,
    from the checkpoint state at `load` (None: from scratch), its state saved to `save`."""
    from ddpgpt import muon
    from ddpgpt.optim import lr_at

    real, calls = muon.newton_schulz, []

    def counting(grad, *args, **kwargs):
        calls.append(tuple(grad.shape))
        return real(grad, *args, **kwargs)

    muon.newton_schulz = counting

    def trainer(mode):
        return make_trainer(env, {
            "model": {"n_layer": 2, "n_head": 2, "n_embd": 30, "block_size": 32},
            "data": {"dir": data, "micro_batch": 1, "global_batch": 12},
            "optim": {"name": "muon", "lr": 1e-2, "muon_lr": 0.05, "warmup_steps": 2,
                      "muon_momentum_warmup": 4},
            "run": {"dir": run_dir, "device": "cpu", "threads": 1, "sync": mode,
                    "bucket_mb": 0.01}})

    def train(t, first, last):
        losses, per_step = [], []
        for k in range(first, last):
            calls.clear()
            loss, _ = t.train_step()
            losses.append((dist.all_reduce(env, loss.detach().clone()) / env.world_size).item())
            t.update(lr_at(k, t.cfg.optim, steps))
            t.step += 1
            per_step.append(dist.all_gather(env, torch.tensor([len(calls)])).flatten().tolist())
        return losses, per_step

    def gathered(value):
        return [json.loads(v) for v in dist.all_gather_text(env, json.dumps(value))]

    out = {}
    for mode in modes:
        t = trainer(mode)
        losses, per_step = train(t, 0, steps)
        opt, mine = t.optimizer, t.sync.matrices.mine
        weights = t.sync.model_state()
        flat = torch.cat([weights[k].detach().flatten() for k in sorted(weights)])
        everyone = dist.all_gather(env, flat)
        out[mode] = {
            "losses": losses, "ns_calls": per_step,
            "momentum": gathered(sorted(i for i, p in zip(mine, opt.matrices)
                                        if "momentum_buffer" in opt.muon.state.get(p, {}))),
            "stepped": gathered(mine),
            "matrices": len(t.sync.matrices.shapes),
            "muon_state": gathered(sum(s["momentum_buffer"].numel()
                                       for s in opt.muon.state.values())),
            "ranks_agree": all(torch.equal(w, everyone[0]) for w in everyone)}
        t.close()
    if chain:
        t = trainer(chain["mode"])
        if chain["load"]:
            saved = torch.load(chain["load"], weights_only=True)
            t.load_state_dict(saved, saved_world_size=saved["world_size"])
        out["chain"], _ = train(t, chain["first"], chain["last"])
        state = t.state_dict()  # collective
        if env.is_main:
            torch.save({**state, "world_size": env.world_size}, chain["save"])
        t.close()
    muon.newton_schulz = real
    return out


def make_trainer(env, flags: dict):
    from ddpgpt.config_io import build
    from ddpgpt.preflight import preflight
    from ddpgpt.reliability import Guard, StopSignal
    from ddpgpt.train import Trainer

    cfg, dataset = preflight(build(None, None, flags), env.world_size, env.local_world_size)
    return Trainer(cfg, env, dataset, Guard(env, cfg.run, StopSignal(announce=False)))


def main() -> None:
    name, args, out = sys.argv[1], json.loads(sys.argv[2]), Path(sys.argv[3])
    with dist.session(device="cpu", group_at_one=args.pop("group_at_one", False)) as env:
        result = globals()[name](env, **args)
        if env.is_main:
            out.write_text(json.dumps(result))



def sync_modes(env, data: str, run_dir: str, steps: int, n_embd: int, modes: list[str],
               resumes: list[list], resume_at: int, compressed: list[str]) -> dict:
    """Trains `steps` steps of the tiny config (G = 8, b = 2) under each mode from the same init.
    Returns per mode: the global losses and gradient norms, the final parameters' largest
    difference from the first mode's, whether every rank holds the same parameters, the
    collectives issued per step and the optimizer-state elements this rank holds; the order in
    which the first allreduce step's gradients became final and its buckets were issued; and,
    for each (from, to) in `resumes`, the losses of a run that trains `resume_at` steps under
    `from`, then goes on under `to` from that state (saved and loaded in memory); and the
    losses and the dtypes sent of each mode in `compressed` with run.grad_compress = bf16."""
    import copy

    from ddpgpt.config_io import build
    from ddpgpt.optim import lr_at
    from ddpgpt.preflight import preflight
    from ddpgpt.reliability import Guard, StopSignal
    from ddpgpt.train import Trainer

    def trainer(mode, compress="none"):
        flags = {"model": {"n_layer": 2, "n_head": 2, "n_embd": n_embd, "block_size": 32},
                 "data": {"dir": data, "micro_batch": 2, "global_batch": 8},
                 "optim": {"lr": 1e-2, "warmup_steps": 2},
                 "run": {"dir": run_dir, "device": "cpu", "threads": 1, "sync": mode,
                         "bucket_mb": 0.01, "grad_compress": compress}}
        cfg, dataset = preflight(build(None, None, flags), env.world_size, env.local_world_size)
        return Trainer(cfg, env, dataset, Guard(env, cfg.run, StopSignal(announce=False)))

    issued, events, sent = [], [], set()
    real = {name: getattr(dist, name) for name in
            ("all_reduce_async", "reduce_scatter_async", "all_gather_async")}

    def recorder(name):
        def issue(*args):
            issued.append(name)
            sent.add(str(args[-1].dtype))
            events.append(("issue", name))
            return real[name](*args)
        return issue

    for name in real:
        setattr(dist, name, recorder(name))

    def train(t, first, last, trace=False):
        losses, norms, per_step = [], [], []
        for k in range(first, last):
            issued.clear()
            if trace and k == first:
                for i, p in enumerate(t.raw.parameters()):  # after the sync's own hooks
                    p.register_post_accumulate_grad_hook(lambda p, i=i: events.append(("ready", i)))
            loss, norm = t.train_step()
            losses.append((dist.all_reduce(env, loss.detach().clone()) / env.world_size).item())
            norms.append(norm.item())
            t.update(lr_at(k, t.cfg.optim, steps))
            per_step.append(list(issued))
            t.step += 1
        return losses, norms, per_step

    def state_elements(optimizer):
        return sum(v.numel() for s in optimizer.state.values() for v in s.values()
                   if torch.is_tensor(v) and v.dim() > 0)

    out, final = {}, {}
    for mode in modes:
        t = trainer(mode)
        losses, norms, per_step = train(t, 0, steps, trace=mode == "allreduce")
        weights = t.sync.model_state()  # whole tensors, whatever the mode shards
        final[mode] = torch.cat([weights[k].detach().flatten() for k in sorted(weights)])
        same = dist.all_gather(env, final[mode])
        out[mode] = {"losses": losses, "norms": norms, "collectives": per_step,
                     "buckets": len(getattr(t.sync, "buckets", [])),
                     "buffer_elements": sum(b.buffer.numel()
                                            for b in getattr(t.sync, "buckets", [])),
                     "state_elements": state_elements(t.optimizer),
                     "local": (t.sync.local_elements(t.optimizer)
                               if hasattr(t.sync, "local_elements") else {}),
                     "params": sum(p.numel() for p in t.raw.parameters()),
                     "max_param_diff": (final[mode] - final[modes[0]]).abs().max().item(),
                     "ranks_agree": all(torch.equal(s, same[0]) for s in same)}
        t.close()
    out["compressed"] = {}
    for mode in compressed:
        sent.clear()
        t = trainer(mode, "bf16")
        losses, _, _ = train(t, 0, steps)
        t.close()
        out["compressed"][mode] = {"losses": losses, "sent": sorted(sent)}
    for name in real:
        setattr(dist, name, real[name])
    out["events"] = events
    out["resumed"] = {}
    for source, target in resumes:
        first = trainer(source)
        head, _, _ = train(first, 0, resume_at)
        state = copy.deepcopy(first.state_dict())
        first.close()
        second = trainer(target)
        second.load_state_dict(state, saved_world_size=env.world_size)
        tail, _, _ = train(second, resume_at, steps)
        second.close()
        out["resumed"][f"{source}->{target}"] = head + tail
    return out

if __name__ == "__main__":
    main()

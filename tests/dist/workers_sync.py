"""Rank functions for the sync-mode and Muon tests (see workers.py)."""

from __future__ import annotations

import json

import torch

from ddpgpt.distributed import collectives
from tests.dist.workers import main, make_trainer


def sync_modes(env, data: str, run_dir: str, steps: int, model: dict, modes: list[str],
               resumes: list[list], resume_at: int, compressed: list[str]) -> dict:
    """Trains `steps` steps of the tiny config (G = 8, b = 2; `model`: the model fields beside 2
    layers and T = 32) under each mode from the same init.
    Returns per mode: the global losses and gradient norms, the final parameters' largest
    difference from the first mode's, whether every rank holds the same parameters, the
    collectives issued per step and the optimizer-state elements this rank holds; the order in
    which the first allreduce step's gradients became final and its buckets were issued; and,
    for each (from, to) in `resumes`, the losses of a run that trains `resume_at` steps under
    `from`, then goes on under `to` from that state (saved and loaded in memory); and the
    losses and the dtypes sent of each mode in `compressed` with run.grad_compress = bf16."""
    import copy

    from ddpgpt.config.io import build
    from ddpgpt.guard.health import Guard, StopSignal
    from ddpgpt.optim.schedule import Schedule
    from ddpgpt.run.preflight import preflight
    from ddpgpt.trainer import Trainer

    def trainer(mode, compress="none"):
        flags = {"model": {"n_layer": 2, "block_size": 32, **model},
                 "data": {"dir": data, "micro_batch": 2, "global_batch": 8},
                 "optim": {"lr": 1e-2, "warmup_steps": 2},
                 "run": {"dir": run_dir, "device": "cpu", "threads": 1, "sync": mode,
                         "bucket_mb": 0.01, "grad_compress": compress}}
        cfg, dataset = preflight(build(None, None, flags), env.world_size, env.local_world_size)
        return Trainer(cfg, env, dataset, Guard(env, cfg.run, StopSignal(announce=False)))

    issued, events, sent = [], [], set()
    real = {name: getattr(collectives, name) for name in
            ("all_reduce_async", "reduce_scatter_async", "all_gather_async")}

    def recorder(name):
        def issue(*args):
            issued.append(name)
            sent.add(str(args[-1].dtype))
            events.append(("issue", name))
            return real[name](*args)
        return issue

    for name in real:
        setattr(collectives, name, recorder(name))

    def train(t, first, last, trace=False):
        losses, norms, per_step = [], [], []
        for k in range(first, last):
            issued.clear()
            if trace and k == first:
                for i, p in enumerate(t.raw.parameters()):  # after the sync's own hooks
                    p.register_post_accumulate_grad_hook(lambda p, i=i: events.append(("ready", i)))
            loss, norm = t.train_step()
            summed = collectives.all_reduce(env, loss.detach().clone())
            losses.append((summed / env.world_size).item())
            norms.append(norm.item())
            t.update(Schedule(t.cfg.optim, steps).at(k))
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
        same = collectives.all_gather(env, final[mode])
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
        setattr(collectives, name, real[name])
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


def muon_modes(env, data: str, run_dir: str, steps: int, modes: list[str],
               chain: dict | None = None, modern: bool = False) -> dict:
    """`steps` Muon steps of a 30-wide model (G = 12 sequences of 32 tokens, b = 1, so every W
    from 1 to 4 divides it; 30 rows split unevenly over 4 fsdp2 shards) under each mode from the
    same init. Per mode: the global losses; each rank's Newton-Schulz calls per step (torch's, at
    the one place torch.optim.Muon calls it); the matrices whose momentum each rank holds, and
    the ones it steps; Muon's and AdamW's state elements per rank; whether every rank ends with
    the same weights. `chain` ({mode, first, last, load, save}): steps first..last under `mode`,
    from the checkpoint state at `load` (None: from scratch), its state saved to `save`."""
    from ddpgpt.optim import muon
    from ddpgpt.optim.schedule import Schedule

    real, calls = muon.newton_schulz, []

    def counting(grad, *args, **kwargs):
        calls.append(tuple(grad.shape))
        return real(grad, *args, **kwargs)

    muon.newton_schulz = counting

    def trainer(mode, arch="gpt2"):
        shape = {"n_head": 2} if arch == "gpt2" else {"n_head": 3, "n_kv_head": 1}
        return make_trainer(env, {
            "model": {"n_layer": 2, "n_embd": 30, "block_size": 32, "arch": arch, **shape},
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
            summed = collectives.all_reduce(env, loss.detach().clone())
            losses.append((summed / env.world_size).item())
            t.update(Schedule(t.cfg.optim, steps).at(k))
            t.step += 1
            counts = collectives.all_gather(env, torch.tensor([len(calls)]))
            per_step.append(counts.flatten().tolist())
        return losses, per_step

    def gathered(value):
        return [json.loads(v) for v in collectives.all_gather_text(env, json.dumps(value))]

    out = {}
    for mode, arch in [(m, "gpt2") for m in modes] + [(m, "modern") for m in modes if modern]:
        t = trainer(mode, arch)
        losses, per_step = train(t, 0, steps)
        opt, mine = t.optimizer, t.sync.matrices.mine
        weights = t.sync.model_state()
        flat = torch.cat([weights[k].detach().flatten() for k in sorted(weights)])
        everyone = collectives.all_gather(env, flat)
        out[mode if arch == "gpt2" else f"{mode} modern"] = {
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


if __name__ == "__main__":
    main(globals())

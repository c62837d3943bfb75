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
    from ddpgpt.config.schema import ModelConfig
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
            losses.append((dist.all_reduce(env, loss.detach().clone()) / env.world_size).item())
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


def muon_modes(env, data: str, run_dir: str, steps: int, modes: list[str],
               chain: dict | None = None) -> dict:
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
            t.update(Schedule(t.cfg.optim, steps).at(k))
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
    from ddpgpt.config.io import build
    from ddpgpt.guard.health import Guard, StopSignal
    from ddpgpt.run.preflight import preflight
    from ddpgpt.trainer import Trainer

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

    from ddpgpt.config.io import build
    from ddpgpt.guard.health import Guard, StopSignal
    from ddpgpt.optim.schedule import Schedule
    from ddpgpt.run.preflight import preflight
    from ddpgpt.trainer import Trainer

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


def checkpoint_memory(env, data: str, run_dir: str, cases: list[list[str]]) -> dict:
    """Per (mode, optimizer), after 2 steps of a 64-wide model: the bytes of the checkpoint this
    rank writes and in all; the largest tensor; and the peak bytes of tensors allocated by this
    thread during a save (allocations counted as ops create them, each until its last tensor is
    freed): written in the calling thread (run.checkpoint_async off), staged for a background
    write (all the step waits for), and gathered whole as the previous store did."""
    import tempfile

    from ddpgpt.checkpoint import sharded
    from ddpgpt.checkpoint.saver import Saver, Stager
    from ddpgpt.optim.schedule import Schedule

    out = {}
    for mode, optimizer in cases:
        t = make_trainer(env, {
            "model": {"n_layer": 2, "n_head": 2, "n_embd": 64, "block_size": 32},
            "data": {"dir": data, "micro_batch": 2, "global_batch": 8},
            "optim": {"name": optimizer, "lr": 1e-2, "warmup_steps": 2},
            "run": {"dir": run_dir, "device": "cpu", "threads": 1, "sync": mode,
                    "bucket_mb": 0.01}})
        for k in range(2):
            t.train_step()
            t.update(Schedule(t.cfg.optim, 2).at(k))
        held, replicated, rest = t.shard_state()
        mine = sharded.share(held, replicated, env.rank, env.world_size)
        written = sum(p.nbytes for p in mine.values())
        # The whole state's bytes, from the logical tensors' shapes (not from what was written):
        # the union of every rank's names, since a rank lists only what it holds.
        sizes = {k: p.shape.numel() * p.chunks[0][1].element_size() for k, p in held.items()}
        total = sum({k: v for text in dist.all_gather_text(env, json.dumps(sizes))
                     for k, v in json.loads(text).items()}.values())
        largest = max(p.shape.numel() * p.chunks[0][1].element_size() for p in held.values())
        root = Path(dist.all_gather_text(env, tempfile.mkdtemp(dir=run_dir))[0])
        saver = Saver(env, root, dist.checkpoint_group(env), "test", keep=5, asynchronous=False)
        with Allocations() as synchronous:
            saver.save(2, held, replicated, rest, {}, wait=True)
        with Allocations() as staged:
            stager = Stager(env.device)
            copy = stager.stage(mine)
        del copy
        with Allocations() as gathered:  # what the previous store took before serializing it
            state = t.state_dict()
        del state
        out[f"{mode} {optimizer}"] = dist.all_gather_text(env, json.dumps({
            "written": written, "total": total, "largest": largest,
            "staged": stager.staged_bytes, "peak_sync": synchronous.peak,
            "peak_staged": staged.peak, "peak_gather": gathered.peak}))
        saver.close()
        t.close()
    return out


class Allocations:
    """Peak bytes of tensor storage that ops run by this thread allocate while it is active
    (torch's dispatcher sees every op; a storage is freed when its last tensor is)."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        outer = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                result = func(*args, **(kwargs or {}))
                outer._seen(result, args)
                return result

        self.mode, self.live, self.now, self.peak = Mode(), {}, 0, 0

    def _seen(self, result, args) -> None:
        import weakref

        from torch.utils._pytree import tree_flatten

        inputs = {_storage(a) for a in tree_flatten(args)[0]}
        for t in tree_flatten(result)[0]:
            key = _storage(t)
            if key is None:
                continue
            if key in inputs and key not in self.live:
                continue  # a view of something allocated before
            if key not in self.live:
                self.live[key] = [t.untyped_storage().nbytes(), 0]
                self.now += self.live[key][0]
                self.peak = max(self.peak, self.now)
            self.live[key][1] += 1
            weakref.finalize(t, self._freed, key)

    def _freed(self, key) -> None:
        self.live[key][1] -= 1
        if self.live[key][1] == 0:
            self.now -= self.live.pop(key)[0]

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)


def _storage(t) -> int | None:
    """The address of a tensor's storage; None for anything else, or a storage without memory
    (meta, or FSDP2's freed unsharded parameters)."""
    if not isinstance(t, torch.Tensor) or t.device.type == "meta":
        return None
    try:
        return t.untyped_storage().data_ptr() or None
    except RuntimeError:
        return None



def saver_failures(env, root: str) -> dict:
    """One save per case through the Saver, on a small state, with a failure on one rank: each
    rank's outcome (the message it raised, or "saved"), the run dir's listing after it, and the
    seconds it took. Cases: `stage` (rank 1 cannot copy its share to memory), `sync-enospc` (rank
    1's write fails with a full disk, run.checkpoint_async off; torch wraps the OS's error),
    `prune` (rank 0 cannot list the old checkpoints after publishing)."""
    import errno
    import os
    import time

    from torch.distributed.checkpoint import filesystem

    from ddpgpt.checkpoint import sharded, store
    from ddpgpt.checkpoint.saver import Saver

    group = dist.checkpoint_group(env, 30)
    held = {"model.w": sharded.whole(torch.ones(6, 4)), "model.b": sharded.whole(torch.ones(4))}
    held.update(sharded.rng(env))
    out = {}
    for case in ("stage", "sync-enospc", "prune"):
        where = Path(root) / case
        saver = Saver(env, where, group, "t", keep=1, asynchronous=case != "sync-enospc")
        restore = []
        if case == "stage" and env.rank == 1:
            def no_memory(state):
                raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to "
                                   "allocate 1000 bytes")
            saver.stager._copy = no_memory
        if case == "sync-enospc" and env.rank == 1:
            real = filesystem._write_item

            def full(*args, **kwargs):
                try:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                except OSError as e:  # as torch's writer does
                    raise RuntimeError("unexpected pos 123 vs 45") from e
            filesystem._write_item = full
            restore.append(lambda real=real: setattr(filesystem, "_write_item", real))
        if case == "prune" and env.is_main:
            real_prune = store.prune

            def unreadable(root, keep):
                raise PermissionError(errno.EACCES, "Permission denied", str(root))
            store.prune = unreadable
            restore.append(lambda real=real_prune: setattr(store, "prune", real))
        dist.barrier(env)
        start = time.perf_counter()
        try:
            saver.save(1, held, {"model.w", "model.b"}, {"x": 1}, {}, wait=True)
            outcome = "saved"
        except Exception as e:
            outcome = f"{type(e).__name__}: {e}"
        took = time.perf_counter() - start
        saver.close()
        for undo in restore:
            undo()
        dist.barrier(env)
        listing = sorted(os.listdir(where)) if where.is_dir() else []
        out[case] = dist.all_gather_text(env, json.dumps([outcome, listing, took]))
    return out


if __name__ == "__main__":
    main()

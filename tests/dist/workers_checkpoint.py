"""Rank functions for the checkpoint tests: memory during a save, the saver's failures (see
workers.py)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ddpgpt.distributed import collectives
from ddpgpt.distributed.group import checkpoint_group
from tests.dist.workers import main, make_trainer


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
        total = sum({k: v for text in collectives.all_gather_text(env, json.dumps(sizes))
                     for k, v in json.loads(text).items()}.values())
        largest = max(p.shape.numel() * p.chunks[0][1].element_size() for p in held.values())
        root = Path(collectives.all_gather_text(env, tempfile.mkdtemp(dir=run_dir))[0])
        saver = Saver(env, root, checkpoint_group(env), "test", keep=5, asynchronous=False)
        with Allocations() as synchronous:
            saver.save(2, held, replicated, rest, {}, wait=True)
        with Allocations() as staged:
            stager = Stager(env.device)
            copy = stager.stage(mine)
        del copy
        with Allocations() as gathered:  # what the previous store took before serializing it
            state = t.state_dict()
        del state
        out[f"{mode} {optimizer}"] = collectives.all_gather_text(env, json.dumps({
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

    group = checkpoint_group(env, 30)
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
        collectives.barrier(env)
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
        collectives.barrier(env)
        listing = sorted(os.listdir(where)) if where.is_dir() else []
        out[case] = collectives.all_gather_text(env, json.dumps([outcome, listing, took]))
    return out


if __name__ == "__main__":
    main(globals())

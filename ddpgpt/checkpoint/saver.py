"""Saving a checkpoint while the training goes on: every rank writes its own share, in the
background, and the checkpoint is published only once every rank's files are durable.

    saver = Saver(env, run_dir.checkpoints, checkpoint_group(env, timeout_s), ...)
    saver.save(step, held, replicated, rest, meta)   # every rank, at the same step
    ...guard.exchange(..., saving=saver.busy)        # every step: is a save still running here?
    saver.settle()      # every rank at once, when none is: its outcome (a failure raises)
    saver.close()       # waits for the save in flight

One save, on every rank:
 1. Wait for the save in flight, if any: at most one at a time, so at most one staged copy.
 2. Stage (run.checkpoint_async): copy this rank's share (sharded.share: its shards, and the
    replicated tensors `writers` gives it, ~1/W of the state) to CPU memory, pinned on a GPU.
    This is all the step waits for. Then dcp.async_save writes the copy in a thread of its own,
    on the checkpoint's own gloo group, so that its collectives never meet the training's.
 3. DCP: each rank writes its file (fsynced), rank 0 the index.
 4. Commit, in a thread: each rank hashes the files it wrote; rank 0 gathers the hashes, writes
    trainer.pt and meta.json last, fsyncs, renames the directory and prunes (store.commit);
    rank 0 then tells every rank the outcome, so every rank raises the same failure at the same
    step (`settle`), and a failed save's temporary directory is removed.
Without run.checkpoint_async the same steps run in the caller, without the copy.

Hang risks: every collective here is on the checkpoint group, which times out after
run.dist_timeout_s like the training's; the rest is this rank's own file writes. A rank that dies
mid-save leaves `.tmp-step_*` behind, never a step directory: the previous checkpoint stays the
newest complete one, and the next start removes the temporary directory.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as torch_dist

from ddpgpt.checkpoint import location, store
from ddpgpt.data import storage
from ddpgpt.distributed import collectives
from ddpgpt.distributed.group import DistEnv, collective
from ddpgpt.errors import UserError, warn
from ddpgpt.files import WriteError, describe, os_error_in

if TYPE_CHECKING:  # DCP (~1 CPU s) is imported where a save starts, not by a launcher's start
    from ddpgpt.checkpoint import sharded


class Stager:
    """dcp.async_save's stager: copies the chunks to CPU memory; counts the bytes it staged. On a
    GPU the buffers are pinned and kept for the next save (pinning is slow); on a CPU they are
    freed with the save."""

    _synchronize_after_execute = False
    should_synchronize_after_execute = False

    def __init__(self, device: torch.device):
        self.keep = device.type == "cuda"
        self.buffers: list[torch.Tensor] = []
        self.staged_bytes = 0
        self.prepared: dict[str, sharded.Pieces] | None = None

    def prepare(self, state: dict[str, sharded.Pieces]) -> None:
        """Copies `state` now, in the caller, so that a failure (out of memory) is known before
        any collective of the save starts; `stage` then hands DCP this copy."""
        self.prepared = self._copy(state)

    def stage(self, state: dict[str, sharded.Pieces]) -> dict[str, sharded.Pieces]:
        staged, self.prepared = self.prepared, None
        return staged if staged is not None else self._copy(state)

    def _copy(self, state: dict[str, sharded.Pieces]) -> dict[str, sharded.Pieces]:
        chunks = [t for pieces in state.values() for _, t in pieces.chunks]
        if not self.keep or [b.shape for b in self.buffers] != [t.shape for t in chunks]:
            self.buffers = [torch.empty(t.shape, dtype=t.dtype, pin_memory=self.keep)
                            for t in chunks]
        copies = iter(self.buffers)
        staged = {k: v.map(lambda t: next(copies).copy_(t, non_blocking=self.keep))
                  for k, v in state.items()}
        if self.keep:
            torch.cuda.synchronize()
        self.staged_bytes = sum(b.numel() * b.element_size() for b in self.buffers)
        if not self.keep:
            self.buffers = []
        return staged

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        self.buffers, self.prepared = [], None


class SaveFailed(WriteError):
    """Checkpoint `step` could not be written; every rank raises it with the same message."""

    def __init__(self, message: str, step: int, quiet: bool = False, fix: str = "free space"):
        super().__init__(message, quiet)
        self.step, self.fix = step, fix


class Saver:
    def __init__(self, env: DistEnv, root: Path, group, token: str, keep: int,
                 asynchronous: bool = True):
        """`group`: the checkpoint's process group (None at W = 1); `token`: the same on every
        rank (rank 0's PID), naming the temporary directories."""
        self.env, self.root, self.group, self.token = env, location.at(root), group, token
        self.keep, self.asynchronous = keep, asynchronous
        self.stager = Stager(env.device)
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ddpgpt-checkpoint")
        self.pending: tuple[int, Future] | None = None   # (step, its commit)
        self.last = -1                                    # the newest step known published
        self.blocked_s = 0.0                              # what the last save cost the caller
        self.waiting = threading.Event()                  # set while the caller waits (faults)

    @property
    def busy(self) -> bool:
        """A save of this rank is still running."""
        return self.pending is not None and not self.pending[1].done()

    @property
    def newest(self) -> int:
        """The newest step known published: the last settled, or the one in flight once its
        commit has succeeded (what a run stopped before settling it names)."""
        if self.pending is not None and self.pending[1].done() and \
                self.pending[1].exception() is None:
            return max(self.last, self.pending[0])
        return self.last

    @property
    def troubled(self) -> int | None:
        """The step of the save in flight if it is still running or has failed, else None: what
        to name when a collective fails (a rank lost mid-save shows in the step's collectives
        first, the save's own running in the background)."""
        if self.pending is None:
            return None
        step, future = self.pending
        return step if not future.done() or future.exception() is not None else None

    def save(self, step: int, held: dict[str, sharded.Pieces], replicated: set[str], rest: dict,
             meta: dict, wait: bool = False) -> None:
        """Starts checkpoint `step` of this rank's `held` tensors (Trainer.shard_state); `rest`
        and `meta` are rank 0's. Every rank calls it at the same step. `wait`: returns once the
        checkpoint is published (or raises why not)."""
        from ddpgpt.checkpoint import sharded

        started = time.perf_counter()
        self.settle()  # at most one in flight
        tmp = store.temporary(self.root, step, self.token)
        mine = sharded.share(held, replicated, self.env.rank, self.env.world_size)
        writer = sharded.writer_for(tmp)
        if self.asynchronous:
            self._stage(step, mine)
            _, upload = sharded.save(mine, tmp, self.group, asynchronous=True, stager=self.stager,
                                     writer=writer)
            future = self.pool.submit(self._commit, step, tmp, writer, upload.result, rest, meta)
        else:
            future = Future()
            try:
                sharded.save(mine, tmp, self.group, writer=writer)
                error = None
            except BaseException as e:  # DCP's failures reach every rank alike
                error = e
            try:
                future.set_result(self._commit(step, tmp, writer, lambda: _reraise(error), rest,
                                               meta))
            except BaseException as e:
                future.set_exception(e)
        self.pending = (step, future)
        self.blocked_s = time.perf_counter() - started
        if wait:
            self.settle()

    def _stage(self, step: int, mine: dict[str, sharded.Pieces]) -> None:
        """Step 2 on every rank, then one exchange (on the checkpoint group, idle now: no save
        is in flight) so that a copy that failed on any rank fails the save on every rank at this
        step, before DCP's collectives start on some ranks only."""
        try:
            self.stager.prepare(mine)
            problem = None
        except Exception as e:  # out of (pinned) memory, most likely
            problem = reason(e, self.env.rank)
        problems = [problem]
        if self.group is not None:
            problems = [None] * self.env.world_size
            with collective():
                torch_dist.all_gather_object(problems, problem, group=self.group)
        failed = next((p for p in problems if p is not None), None)
        if failed is not None:
            self.stager.prepared = None
            final = store.step_dir(self.root, step)
            raise SaveFailed(f"cannot copy checkpoint {final} to memory: {failed}", step,
                             quiet=not self.env.is_main,
                             fix="free memory (or write in the step: --no-run.checkpoint-async)")

    def settle(self) -> None:
        """Waits for the save in flight, if any, and raises its failure: the same on every rank,
        so every rank calls it at the same step (when none is busy, or before the next save)."""
        if self.pending is None:
            return
        step, future = self.pending
        self.waiting.set()
        try:
            future.result()
        finally:
            self.waiting.clear()
            self.pending = None
        self.last = step

    def close(self) -> None:
        """Waits for the save in flight (its collectives time out like any other) and stops the
        thread. A failure is not raised here: this runs on the way out of an error already."""
        try:
            self.settle()
        except BaseException:
            pass
        self.pool.shutdown(wait=True)
        self.stager.close()

    # ---- in the background ----------------------------------------------------------------------

    def _commit(self, step: int, tmp: Path, writer, written, rest: dict, meta: dict) -> None:
        """Steps 3-4 above on every rank; collective over the checkpoint group."""
        from ddpgpt.checkpoint import sharded

        final = store.step_dir(self.root, step)
        hashes, problem, own = {}, None, False
        try:
            written()  # DCP's own outcome: a CheckpointException names every rank that failed
            names = writer.files + ([sharded.INDEX] if self.env.is_main else [])
            hashes = store.hash_files(tmp, names, getattr(writer, "digests", None))
        except BaseException as e:  # this rank's own error says most: it has the OS's reason
            own = getattr(writer, "error", None) is not None or sharded.failures(e)[0][0] is None
            problem = reason(getattr(writer, "error", None) or e, self.env.rank, final)
        gathered = self._gather((hashes, problem, own))
        outcome = None
        if self.env.is_main:
            problems = sorted((not own, r, p) for r, (_, p, own) in enumerate(gathered)
                              if p is not None)
            outcome = (problems[0][2] if problems
                       else self._publish(tmp, final, gathered, rest, meta))
        outcome = self._broadcast(outcome)
        if outcome is not None:
            store.discard(tmp, final)
            remote = location.is_remote(final)
            left = ("what was uploaded of it has no meta.json and is never loaded" if remote
                    else "its temporary files were removed")
            raise SaveFailed(f"cannot write checkpoint {final}: {outcome}; {left}", step,
                             quiet=not self.env.is_main,
                             fix="wait until the storage answers" if remote else "free space")

    def _publish(self, tmp: Path, final: Path, gathered: list, rest: dict, meta: dict
                 ) -> str | None:
        """Rank 0: trainer.pt, meta.json, the rename, keep-last-k. The reason it failed, or None."""
        files = {name: digest for hashes, _, _ in gathered for name, digest in hashes.items()}
        try:
            store.commit(tmp, final, files, rest,
                              {"world_size": self.env.world_size, **meta})
        except BaseException as e:  # whatever it is, every rank must hear of it (the broadcast)
            return reason(e, 0, final)
        try:
            store.prune(self.root, self.keep, meta.get("healthy_checkpoint"))
        except Exception as e:  # the checkpoint is published; an old one stays
            warn(f"could not prune old checkpoints in {self.root} ({e}); training goes on")
        return None

    def _gather(self, item) -> list:
        """Every rank's item, on rank 0 (others get [])."""
        if self.group is None:
            return [item]
        out = [None] * self.env.world_size if self.env.is_main else None
        with collective():
            torch_dist.gather_object(item, out, dst=0, group=self.group)
        return out or []

    def _broadcast(self, item):
        if self.group is None:
            return item
        box = [item]
        with collective():
            torch_dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]


def _reraise(error: BaseException | None) -> None:
    if error is not None:
        raise error


def reason(error: BaseException, rank: int, where=None) -> str:
    """Why a save failed, in a few words: the OS's reason (a full disk) or object storage's
    (storage.explain: access denied, the server gone) and the rank that met it; anything else
    (a bug) by its type and message."""
    from ddpgpt.checkpoint import sharded

    for failed, exc in sharded.failures(error):
        line = _storage_reason(exc, where)
        if line is not None:
            return f"{line} (rank {rank if failed is None else failed})"
        cause = os_error_in(exc)
        if cause is not None:
            return f"{describe(cause)} on rank {rank if failed is None else failed}"
    failed, exc = sharded.failures(error)[0]
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text} on rank {rank if failed is None else failed}"


def _storage_reason(error: BaseException, where) -> str | None:
    """Object storage's failure behind `error`, in its one line (without the URL: the message
    names the checkpoint), or None."""
    if where is None or not location.is_remote(where):
        return None
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, UserError):
            return str(error)
        line = storage.explain(error, str(where), "writing")
        if line is not None:
            return line.removeprefix(f"writing {where}: ")
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def token(env: DistEnv) -> str:
    """Rank 0's PID, on every rank (collective): names this run's temporary directories."""
    return collectives.all_gather_text(env, str(os.getpid()))[0]

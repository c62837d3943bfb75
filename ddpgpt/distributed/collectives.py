"""Collectives over the process group, each a no-op at world size 1 so that callers never
branch on W; a lost or stalled peer becomes a CollectiveError (one line); and the agreement
checks (digests compared across ranks) that prove the ranks built the same thing."""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist

from ddpgpt.distributed.group import DistEnv, DistError, collective
from ddpgpt.errors import UserError

# ---- collectives: no-ops at world size 1 ----------------------------------------------------

def all_reduce(env: DistEnv, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """In place; `op` is sum or max."""
    if env.world_size > 1:
        with collective():
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
    return tensor


def all_gather(env: DistEnv, tensor: torch.Tensor) -> torch.Tensor:
    """(W, *tensor.shape): every rank's tensor, on every rank."""
    if env.world_size == 1:
        return tensor.unsqueeze(0)
    out = [torch.empty_like(tensor) for _ in range(env.world_size)]
    with collective():
        dist.all_gather(out, tensor)
    return torch.stack(out)


def all_gather_text(env: DistEnv, text: str | None) -> list[str | None]:
    """Every rank's string (or None), on every rank."""
    if env.world_size == 1:
        return [text]
    out: list = [None] * env.world_size
    with collective():
        dist.all_gather_object(out, text)
    return out


def all_reduce_async(env: DistEnv, tensor: torch.Tensor) -> dist.Work:
    """Sum in place, issued now, done when the returned work's wait() returns."""
    with collective():
        return dist.all_reduce(tensor, async_op=True)


# torch 2.13 names them *_single; 2.4 has only the *_tensor names.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def reduce_scatter_async(env: DistEnv, shard: torch.Tensor, full: torch.Tensor) -> dist.Work:
    """shard (n/W,) <- the sum over ranks of this rank's n/W slice of `full` (n,)."""
    with collective():
        return _reduce_scatter(shard, full, async_op=True)


def all_gather_async(env: DistEnv, full: torch.Tensor, shard: torch.Tensor) -> dist.Work:
    """full (n,) <- every rank's shard (n/W,), in rank order."""
    with collective():
        return _all_gather(full, shard, async_op=True)


def all_gather_into(env: DistEnv, full: torch.Tensor, shard: torch.Tensor) -> None:
    """full (W·n,) <- every rank's shard (n,), in rank order; one buffer, no list of W."""
    if env.world_size == 1:
        full.copy_(shard.reshape(-1))
        return
    work = all_gather_async(env, full, shard)
    with collective():
        work.wait()


def all_to_all(env: DistEnv, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int],
               in_splits: list[int]) -> None:
    """out <- from each rank r, in rank order, its next out_splits[r] elements; `inp` is cut
    into in_splits[r] elements for each rank r in turn (uneven splits allowed)."""
    if env.world_size == 1:
        out.copy_(inp)
        return
    with collective():
        dist.all_to_all_single(out, inp, out_splits, in_splits)


def barrier(env: DistEnv) -> None:
    if env.world_size > 1:
        with collective():
            dist.barrier()


def fail_together(env: DistEnv, error: Exception | None) -> None:
    """Every rank learns whether any rank hit an error, so all exit together rather than hang.

    Each rank that failed raises its own error; the lowest of them prints it, the others
    quietly (W ranks reading the same bad file, or each its own bad shard, say it once: one line
    to act on, then the next run names the next problem). The ranks that did not fail raise
    quietly too, with the lowest failing rank's exit code: a launcher reports whichever worker
    exited first, and bad input is exit 2 whichever rank that is."""
    code = getattr(error, "exit_code", 1)
    messages = all_gather_text(env, None if error is None else f"{code} {error}")
    if error is not None:
        if any(m is not None for m in messages[:env.rank]) and isinstance(error, UserError):
            error.quiet = True
        raise error
    failed = [r for r, m in enumerate(messages) if m is not None]
    if failed:
        stop = DistError(f"stopping: rank {', '.join(map(str, failed))} failed (see its message)",
                         quiet=True)
        stop.exit_code = int(messages[failed[0]].split(" ", 1)[0])
        raise stop


def together(env: DistEnv, fn, main_only: bool = False):
    """Runs `fn` on every rank (or rank 0 alone) and returns its result; a UserError it raises
    ends every rank together (see fail_together)."""
    result, error = None, None
    if env.is_main or not main_only:
        try:
            result = fn()
        except UserError as e:
            error = e
    fail_together(env, error)
    return result


def digest(*parts: bytes | str) -> bytes:
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode() if isinstance(part, str) else part)
    return h.digest()


def state_digest(state: dict[str, torch.Tensor]) -> bytes:
    """sha256 over every tensor's name and exact bytes (a model's state_dict)."""
    h = hashlib.sha256()
    for name, t in state.items():
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.digest()


def agree(env: DistEnv, items: dict[str, tuple[bytes, str]]) -> None:
    """Every rank checks that all ranks hold the same digest for each item, in one all_gather.

    items: {what: (digest, how to fix)}, in the order a reader should see them (a cause before
    its effects). Every item that differs is named, with the ranks that differ from rank 0; every
    rank raises the same DistError, so all stop together (rank 0 prints)."""
    if env.world_size == 1:
        return
    local = torch.tensor([list(d) for d, _ in items.values()], dtype=torch.uint8, device=env.device)
    gathered = all_gather(env, local).cpu()  # (W, items, 32)
    problems = []
    for i, (what, (_, fix)) in enumerate(items.items()):
        differ = [r for r in range(env.world_size)
                  if not torch.equal(gathered[r, i], gathered[0, i])]
        if differ:
            ranks = ", ".join(map(str, differ))
            problems.append(f"{what}: rank{'s' if len(differ) > 1 else ''} {ranks} "
                            f"differ{'' if len(differ) > 1 else 's'} from rank 0; {fix}")
    if problems:
        raise DistError("ranks disagree on " + "; and on ".join(problems), quiet=env.rank != 0)

"""Processes, devices and collectives: the only module that reads torchrun's environment
(RANK, LOCAL_RANK, WORLD_SIZE, ...) or touches process groups.

    env = detect()                      # environment only: usable before any group exists
    with session(device="auto") as env: # group created (W > 1), destroyed on every exit path
        model = wrap_model(model, env)  # DDP when W > 1, the model itself otherwise
        all_reduce(env, t)              # no-op at W = 1, so callers never branch on W

A `DistEnv`'s defaults describe world size 1: rank 0 of 1, CPU, no process group.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import inspect
import os
import sys
import traceback
from dataclasses import dataclass, field, replace
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ddpgpt.errors import UserError


class DistError(UserError):
    """A distributed failure. When every rank raises it together, rank 0 alone prints it (the
    others are `quiet`); a failure one rank observed on its own is printed by that rank."""

    exit_code = 1


@dataclass(frozen=True)
class DistEnv:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    backend: str | None = None  # None: no process group (world size 1)
    restart_count: int = 0      # how many times torchrun has restarted this worker group

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    try:
        return default if value is None else int(value)
    except ValueError:
        raise UserError(f"environment variable {name}={value!r} is not an integer") from None


def detect() -> DistEnv:
    """Rank and world size from torchrun's environment (defaults: one process); no group, CPU."""
    world = _env_int("WORLD_SIZE", 1)
    return DistEnv(rank=_env_int("RANK", 0), local_rank=_env_int("LOCAL_RANK", 0), world_size=world,
                   local_world_size=_env_int("LOCAL_WORLD_SIZE", world),
                   restart_count=_env_int("TORCHELASTIC_RESTART_COUNT", 0))


def resolve_device(kind: str, local_rank: int) -> torch.device:
    """cuda:LOCAL_RANK (not RANK: ranks count across nodes, devices within one) or cpu."""
    if kind == "cpu" or (kind == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise UserError("run.device = cuda but CUDA is not available; use --device cpu or auto")
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise UserError(f"local rank {local_rank} has no GPU: only {count} visible "
                        "(CUDA_VISIBLE_DEVICES); start at most that many processes per node")
    return torch.device("cuda", local_rank)


def init(device: str = "auto", backend: str = "auto", timeout_s: float = 600) -> DistEnv:
    """Binds this process to its device and, when W > 1, joins the process group.

    `timeout_s` bounds every collective: a rank that dies or stalls ends the others with an error
    after that long instead of a hang (gloo's default would be 30 minutes)."""
    env = detect()
    dev = resolve_device(device, env.local_rank)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if env.world_size == 1:
        return replace(env, device=dev)
    name = backend if backend != "auto" else ("nccl" if dev.type == "cuda" else "gloo")
    timeout = timedelta(seconds=timeout_s)
    try:
        dist.init_process_group(name, timeout=timeout, device_id=dev if dev.type == "cuda" else None,
                                **_attempt_store(env, timeout))
    except RuntimeError as e:  # DistNetworkError and friends
        if "address already in use" not in str(e).lower():
            raise
        where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
        raise UserError(f"rank {env.rank}: cannot open the rendezvous port {where}: address already in use; "
                        "another job holds it: choose another MASTER_PORT / --rdzv-endpoint port") from None
    return replace(env, device=dev, backend=name)


def _attempt_store(env: DistEnv, timeout: timedelta) -> dict:
    """Under torchrun, the group's rendezvous keys in a namespace of this attempt.

    torchrun's workers share its agent's TCPStore, and since torch 2.x (checked on 2.13) keys are
    no longer prefixed per elastic attempt: after a restart a rank can read the previous attempt's
    gloo address (or NCCL id) of a dead peer and fail or hang forming the group. A prefix per
    TORCHELASTIC_RESTART_COUNT keeps attempts apart. Outside torchrun: the default env:// path."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), env.world_size,
                         is_master=False, timeout=timeout)
    store = dist.PrefixStore(f"ddpgpt/attempt_{env.restart_count}", base)
    return {"store": store, "rank": env.rank, "world_size": env.world_size}


COLLECTIVE_FAILURES = ("timed out", "connection closed", "connection reset", "nccl", "gloo", "broken pipe")


def is_collective_failure(error: BaseException) -> bool:
    """A lost or stalled peer, as gloo and NCCL report it (plain RuntimeErrors in torch 2.x)."""
    if isinstance(error, getattr(dist, "DistError", ())):
        return True
    return isinstance(error, RuntimeError) and any(k in str(error).lower() for k in COLLECTIVE_FAILURES)


def collective_failure(error: BaseException, env: DistEnv, step: int, timeout_s: float) -> DistError:
    """The one line for a collective that failed during `step`: this rank lost a peer."""
    first = str(error).strip().splitlines()[0]
    first = first.split("] ", 1)[-1][:160]  # drop gloo's source-file prefix
    return DistError(f"step {step}: a collective failed on rank {env.rank} ({first}); another rank stalled "
                     f"or died (see its log). Collectives wait at most run.dist_timeout_s = {timeout_s:g} s")


def fail_together(env: DistEnv, error: Exception | None) -> None:
    """Every rank learns whether any rank hit an error: the rank that did raises (and prints) its
    own; the others raise a quiet DistError, so all exit together rather than hang."""
    failed = all_gather(env, torch.tensor([error is not None], dtype=torch.uint8, device=env.device)).cpu()
    if error is not None:
        raise error
    if failed.any():
        ranks = ", ".join(str(r) for r in range(env.world_size) if failed[r])
        raise DistError(f"stopping: rank {ranks} failed (see its message)", quiet=True)


def shutdown() -> None:
    """Destroys the group. A DDP wrapper that outlives its group can abort the process (SIGABRT)
    as it is torn down at exit, seen now and then with gloo on a loaded machine, so callers drop
    theirs first and unreachable ones are collected here."""
    if dist.is_available() and dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()


@contextlib.contextmanager
def session(device: str = "auto", backend: str = "auto", timeout_s: float = 600):
    """`init` on entry; `destroy_process_group` on every exit: normal end, exception, Ctrl-C."""
    env = init(device, backend, timeout_s)
    try:
        yield env
    except BaseException as e:
        # The failed frames' locals (a DDP wrapper among them) must not outlive the group.
        traceback.clear_frames(e.__traceback__)
        raise
    finally:
        shutdown()


# ---- collectives: no-ops at world size 1 ----------------------------------------------------

def all_reduce(env: DistEnv, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """In place; `op` is sum or max."""
    if env.world_size > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
    return tensor


def all_gather(env: DistEnv, tensor: torch.Tensor) -> torch.Tensor:
    """(W, *tensor.shape): every rank's tensor, on every rank."""
    if env.world_size == 1:
        return tensor.unsqueeze(0)
    out = [torch.empty_like(tensor) for _ in range(env.world_size)]
    dist.all_gather(out, tensor)
    return torch.stack(out)


def barrier(env: DistEnv) -> None:
    if env.world_size > 1:
        dist.barrier()


def digest(*parts: bytes | str) -> bytes:
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode() if isinstance(part, str) else part)
    return h.digest()


def params_digest(model: torch.nn.Module) -> bytes:
    """sha256 over every parameter's name and exact bytes."""
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.digest()


def agree(env: DistEnv, items: dict[str, tuple[bytes, str]]) -> None:
    """Every rank checks that all ranks hold the same digest for each item, in one all_gather.

    items: {what: (digest, how to fix)}. On a difference every rank raises the same DistError,
    naming the ranks that differ from rank 0, so all stop together (rank 0 prints)."""
    if env.world_size == 1:
        return
    local = torch.tensor([list(d) for d, _ in items.values()], dtype=torch.uint8, device=env.device)
    gathered = all_gather(env, local).cpu()  # (W, items, 32)
    for i, (what, (_, fix)) in enumerate(items.items()):
        differ = [r for r in range(env.world_size) if not torch.equal(gathered[r, i], gathered[0, i])]
        if differ:
            ranks = ", ".join(map(str, differ))
            raise DistError(f"ranks disagree on {what}: rank{'s' if len(differ) > 1 else ''} {ranks} "
                            f"differ{'' if len(differ) > 1 else 's'} from rank 0; {fix}", quiet=env.rank != 0)


# ---- data parallelism ---------------------------------------------------------------------

def wrap_model(model: torch.nn.Module, env: DistEnv, bucket_mb: float = 25.0) -> torch.nn.Module:
    """DDP when W > 1, else the model itself.

    init_sync=False: DDP would otherwise broadcast rank 0's weights and hide a rank that built
    different ones; ranks instead build identical weights from one seed and `agree` proves it.
    broadcast_buffers=False: the model has no buffers that change during training."""
    if env.world_size == 1:
        return model
    # torch >= 2.12 renames broadcast_buffers to forward_sync_buffers (and warns on the old name).
    params = inspect.signature(DistributedDataParallel.__init__).parameters
    no_buffer_sync = {"forward_sync_buffers" if "forward_sync_buffers" in params else "broadcast_buffers": False}
    return DistributedDataParallel(
        model, device_ids=[env.device.index] if env.device.type == "cuda" else None,
        init_sync=False, bucket_cap_mb=bucket_mb, gradient_as_bucket_view=True, **no_buffer_sync,
    )


def sync_gradients(model: torch.nn.Module, enabled: bool):
    """Context for one micro-step's forward+backward: with enabled=False, DDP skips its gradient
    all-reduce (the gradients accumulate locally); the last micro-step of a step syncs them all."""
    ddp = getattr(model, "_orig_mod", model)
    if enabled or not isinstance(ddp, DistributedDataParallel):
        return contextlib.nullcontext()
    return ddp.no_sync()


# ---- launching local processes --------------------------------------------------------------

def strip_flags(argv: list[str], flags: tuple[str, ...]) -> list[str]:
    """argv without `--flag VALUE` / `--flag=VALUE` for each of `flags`."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in flags:
            skip = True
        elif not arg.startswith(tuple(f + "=" for f in flags)):
            out.append(arg)
    return out



def launch(nproc: int, argv: list[str], drop: tuple[str, ...], max_restarts: int = 0, device: str = "auto") -> int:
    """Starts `python -m ddpgpt <argv without the flags in drop>` on `nproc` local processes
    through torch's elastic launcher: the same as `torchrun --standalone --nproc_per_node N -m
    ddpgpt ...`. Returns the exit code (the first failed worker's)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    from ddpgpt.preempt import EXIT_PREEMPTED

    if detect().world_size > 1:
        raise UserError("--nproc starts processes itself; under torchrun leave it out")
    if device != "cpu" and torch.cuda.is_available() and nproc > torch.cuda.device_count():
        n = torch.cuda.device_count()
        raise UserError(f"--nproc {nproc} but only {n} GPU{' is' if n == 1 else 's are'} visible; "
                        "use --nproc <= that, or --device cpu")
    # Workers set their own thread count (run.threads); this also silences torchrun's banner.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    args = parse_args(["--standalone", f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}",
                       "--monitor-interval=0.5", "-m", "ddpgpt", *strip_flags(argv, drop)])
    try:
        run(args)
    except SignalException as e:
        # The launcher forwarded the signal to every worker and waited for them to stop: each
        # stops at its next step boundary and checkpoints first (see preempt.py).
        print(f"ddpgpt: stopped by {e.sigval.name}; the workers checkpointed before exiting: "
              "run the same command to resume", file=sys.stderr)
        return EXIT_PREEMPTED
    except ChildFailedError as e:
        first = next(iter(e.failures.values()))
        code = first.exitcode if first.exitcode > 0 else 1
        print(f"ddpgpt: a worker failed (local rank {first.local_rank}, exit code {first.exitcode}); "
              "the group was stopped", file=sys.stderr)
        return code
    return 0

"""Processes, devices and the process group's life: the only module that reads torchrun's
environment (RANK, LOCAL_RANK, WORLD_SIZE, ...) or creates and destroys process groups (the
collectives over them are collectives.py's).

    env = detect()                      # environment only: usable before any group exists
    with session(device="cpu") as env:  # group created (W > 1), destroyed on every exit path
        all_reduce(env, t)              # no-op at W = 1, so callers never branch on W

A `DistEnv`'s defaults describe world size 1: rank 0 of 1, CPU, no process group, attempt 1.

Elastic jobs (`torchrun --nnodes MIN:MAX`): `elastic_nodes()` reads the range the launcher was
given, and `launcher_id()` names the launcher (torchrun's elastic agent, or `--nproc`'s) that
started this process. A job's first start is one whose launchers have not run it before; the run
dir records them (see elastic.py), because torch's stores do not survive the loss of the node
that hosts them.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import signal
import socket
import sys
import time
import traceback
import uuid
from dataclasses import dataclass, field, replace
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from ddpgpt.errors import UserError


class DistError(UserError):
    """A distributed failure. When every rank raises it together, rank 0 alone prints it (the
    others are `quiet`); a failure one rank observed on its own is printed by that rank."""

    exit_code = 1


class CollectiveError(DistError):
    """A collective that failed on this rank: a peer died or stalled past the timeout."""


@dataclass(frozen=True)
class DistEnv:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    backend: str | None = None  # None: no process group (world size 1)
    attempt: int = 1            # which start of this job's store: names the group's keys in it
    launcher: str | None = None  # "host:pid:start" of the launcher that started this process
    first_start: bool = True    # the job's first start (decided by elastic.claim, not here)

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
                   launcher=launcher_id() if under_launcher() else None)


def under_launcher() -> bool:
    """Started by torchrun's elastic agent (or `--nproc`, which runs the same agent)."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def launcher_id() -> str:
    """The launcher that started this process (its parent), as "host:pid:start": the start time
    (Linux: clock ticks after boot) tells a launcher from a later process that reuses its PID."""
    parent = os.getppid()
    try:
        stat = Path(f"/proc/{parent}/stat").read_text()
        started = stat.rsplit(")", 1)[1].split()[19]  # field 22: after the name's closing ")"
    except (OSError, IndexError):
        started = "?"
    return f"{socket.gethostname()}:{parent}:{started}"


def elastic_nodes() -> tuple[int, int] | None:
    """(MIN, MAX) of torchrun's --nnodes when torchrun started this process (from its command
    line, else PET_NNODES, which torchrun also reads); None otherwise (one process, `--nproc`,
    or a launcher that does not say)."""
    if not under_launcher():
        return None
    try:
        argv = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().decode().split("\0")
    except OSError:
        argv = []
    return parse_nnodes(argv, os.environ.get("PET_NNODES"))


def parse_nnodes(argv: list[str], default: str | None) -> tuple[int, int] | None:
    """(MIN, MAX) from a torchrun command line (`--nnodes 1:4`, `--nnodes=2`, `--standalone`),
    else from `default` (the same syntax); None when neither says or it does not parse."""
    value = default
    for i, arg in enumerate(argv):
        if arg == "--standalone":
            value = "1"
        elif arg == "--nnodes" and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith("--nnodes="):
            value = arg.split("=", 1)[1]
        else:
            continue
        break
    try:
        low, _, high = (value or "").partition(":")
        return int(low), int(high or low)
    except ValueError:
        return None


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


def default_backend(device_kind: str) -> str:
    return "nccl" if device_kind == "cuda" else "gloo"


def die_with_launcher() -> None:
    """Linux: this process is SIGKILLed when its launcher dies. Without it, workers whose
    launcher was killed train on to the end and write checkpoints that a relaunch would race."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if parent == 1 or os.getppid() != parent:  # it died before the line above took effect
        os.kill(os.getpid(), signal.SIGKILL)


def init(device: str = "auto", backend: str = "auto", timeout_s: float = 600,
         group_at_one: bool = False) -> DistEnv:
    """Binds this process to its device and, when W > 1, joins the process group.

    `timeout_s` bounds every collective: a rank that dies or stalls ends the others with an error
    after that long instead of a hang (gloo's default would be 30 minutes). `group_at_one` makes
    a one-rank group when W = 1 (`ddpgpt bench --group`: the sync modes' collectives for real)."""
    env = detect()
    if under_launcher():
        die_with_launcher()
    dev = resolve_device(device, env.local_rank)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    timeout = timedelta(seconds=timeout_s)
    job_store = _job_store(env, timeout)
    attempt = _attempt(job_store, env.rank, env.world_size, timeout_s) if job_store else 1
    env = replace(env, device=dev, attempt=attempt)
    if env.world_size == 1 and not group_at_one:
        return env
    name = backend if backend != "auto" else default_backend(dev.type)
    store = {}
    if env.world_size == 1 and job_store is None:  # nobody to meet: an in-process store
        store = {"store": dist.HashStore(), "rank": 0, "world_size": 1}
    elif job_store is not None:  # this attempt's own namespace: no key of an earlier one is seen
        store = {"store": dist.PrefixStore(f"ddpgpt/attempt_{attempt}", job_store),
                 "rank": env.rank, "world_size": env.world_size}
    try:
        dist.init_process_group(name, timeout=timeout,
                                device_id=dev if dev.type == "cuda" else None, **store)
    except RuntimeError as e:  # DistNetworkError and friends
        if "address already in use" not in str(e).lower():
            raise
        where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
        raise UserError(f"rank {env.rank}: cannot open the rendezvous port {where}: address "
                        "already in use; another job holds it: choose another MASTER_PORT / "
                        "--rdzv-endpoint port") from None
    return replace(env, backend=name)


def _job_store(env: DistEnv, timeout: timedelta) -> dist.Store | None:
    """Under torchrun: a client of the agents' store, which lives as long as the job. Else None."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), env.world_size,
                         is_master=False, timeout=timeout)


def _attempt(store: dist.Store, rank: int, world_size: int, timeout_s: float) -> int:
    """The number of this start of the job (1, 2, ...): the same on every rank, new each time.

    torchrun keeps one store for the whole job and (torch 2.x) no longer namespaces the workers'
    keys per restart, so a restarted rank can read a dead peer's address and fail to form the
    group. TORCHELASTIC_RESTART_COUNT cannot name the attempt: an agent that restarts for another
    node's failure does not count it, so nodes disagree. Instead rank 0 draws the next number from
    the store, and every other rank receives it in answer to a nonce of its own, so that no rank
    can take an earlier attempt's number for this one; rank 0 waits until every rank has it.

    The store lives in the agent of the first start's node 0: when that node dies, the survivors
    get a new store and count from 1 again. So the number only keeps the group's keys apart; it
    does not say whether this is the job's first start (elastic.claim decides that)."""
    deadline = time.monotonic() + timeout_s
    if rank > 0:
        nonce = uuid.uuid4().hex
        store.set(f"ddpgpt/hello/{rank}", nonce)
        answer = f"ddpgpt/welcome/{rank}/{nonce}"
        store.wait([answer], timedelta(seconds=timeout_s))
        attempt = int(store.get(answer))
        store.set(f"ddpgpt/ready/{attempt}/{rank}", "1")
        return attempt
    attempt = store.add("ddpgpt/attempts", 1)
    answered: dict[int, bytes] = {}
    waiting = set(range(1, world_size))
    while waiting:
        for r in sorted(waiting):
            hello = f"ddpgpt/hello/{r}"
            if store.check([hello]) and (nonce := store.get(hello)) != answered.get(r):
                # A stale nonce is answered too (harmlessly): only this attempt's rank waits.
                store.set(f"ddpgpt/welcome/{r}/{nonce.decode()}", str(attempt))
                answered[r] = nonce
            if store.check([f"ddpgpt/ready/{attempt}/{r}"]):
                waiting.discard(r)
        if time.monotonic() > deadline:
            raise DistError(f"rank 0: rank{'s' if len(waiting) > 1 else ''} "
                            f"{', '.join(map(str, sorted(waiting)))} did not start within "
                            f"{timeout_s:g} s (run.dist_timeout_s)")
        time.sleep(0.01)
    return attempt


def serve_store(host: str, port: int, ready=None) -> None:
    """Hosts a TCPStore until this process is stopped: the c10d rendezvous store for elastic
    jobs whose agents all connect to it. torchrun's agents keep the rendezvous state in the store
    of the endpoint's host; when a training node hosts it, losing that node ends the job on every
    node. `ready()` is called once the store listens."""
    try:
        store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                              multi_tenant=True)
    except (RuntimeError, ValueError) as e:
        raise UserError(f"cannot listen on {host}:{port} ({str(e).splitlines()[0][:120]}); "
                        "choose another --port") from None
    if ready:
        ready()
    while store is not None:  # the store serves from its own thread
        time.sleep(3600)


@contextlib.contextmanager
def collective():
    """Around code that runs collectives: their failure becomes a CollectiveError.

    gloo reports a lost or stalled peer as a plain RuntimeError (torch 2.13), so the failure is
    known by where it happened, not by its type; running out of memory is not a lost peer."""
    try:
        yield
    except torch.OutOfMemoryError:
        raise
    except RuntimeError as e:  # DistBackendError, DistNetworkError, ... are RuntimeErrors too
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CollectiveError(first.split("] ", 1)[-1][:160]) from e  # drop gloo's file prefix


def checkpoint_group(env: DistEnv, timeout_s: float = 600):
    """A second group of every rank, gloo, for the checkpoint's collectives (None without a
    process group). They run in a background thread while the step's run on the default group:
    two groups never wait on each other's operations. gloo on GPUs too, since torch's
    asynchronous checkpoint needs a CPU backend. Collective: every rank creates it, once."""
    if env.backend is None:
        return None
    with collective():
        return dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))


def shutdown() -> None:
    """Destroys the group. A DDP wrapper that outlives its group can abort the process (SIGABRT)
    as it is torn down at exit, seen now and then with gloo on a loaded machine, so callers drop
    theirs first and unreachable ones are collected here."""
    if dist.is_available() and dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()


@contextlib.contextmanager
def session(device: str = "auto", backend: str = "auto", timeout_s: float = 600,
            group_at_one: bool = False):
    """`init` on entry; `destroy_process_group` on every exit: normal end, exception, Ctrl-C."""
    env = init(device, backend, timeout_s, group_at_one)
    try:
        yield env
    except BaseException as e:
        # The failed frames' locals (a DDP wrapper among them) must not outlive the group.
        traceback.clear_frames(e.__traceback__)
        raise
    finally:
        shutdown()

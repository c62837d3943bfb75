"""`--nproc N`: N local worker processes through torch's elastic agent, exactly what
`torchrun --standalone --nproc_per_node N -m ddpgpt ...` runs, and what the launcher reports.

For training, the launcher first does everything that needs no worker: it resolves the config,
checks the data, the run dir and where the run starts (bad input is one line before any worker
exists), takes the run dir's lock and holds it for the whole job (restarts included), and writes
the resolved config.json. The workers start from that file (`train --resolved-config`, with this
start's own run.resume and run.threads) rather than from the command line. A worker whose
launcher dies is killed with it (die_with_launcher).

The workers run this package's __main__.py by its path (ENTRY), not `-m ddpgpt`: `-m` would
put the current directory first on their sys.path, and a `ddpgpt` folder there (the parent of a
clone, an older copy) would be what they import instead of the launcher's package.

Exit codes: the workers' (0; 1 a run-time failure; 2 bad input; 75 stopped with a checkpoint),
or 128+N when a worker or the launcher was ended by signal N without one.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from pathlib import Path

import torch

from ddpgpt.checkpoint import store
from ddpgpt.config.io import START_FIELDS
from ddpgpt.config.schema import TrainConfig
from ddpgpt.distributed.group import detect, under_launcher
from ddpgpt.errors import UserError
from ddpgpt.evals.tasks import for_run
from ddpgpt.guard.health import EXIT_PREEMPTED, resume_hint
from ddpgpt.run import resume
from ddpgpt.run.preflight import preflight
from ddpgpt.run.run_dir import RunDir

# How a process of ours starts ddpgpt: the launcher's own package, whatever the current
# directory holds (ddpgpt/__main__.py).
ENTRY = str(Path(__file__).resolve().parent.parent / "__main__.py")


def check_nproc(nproc: int, device: str) -> None:
    if nproc < 1:
        raise UserError(f"--nproc {nproc} must be >= 1")
    if detect().world_size > 1:
        raise UserError("--nproc starts processes itself; under torchrun leave it out")
    if device != "cpu" and torch.cuda.is_available() and nproc > torch.cuda.device_count():
        n = torch.cuda.device_count()
        raise UserError(f"--nproc {nproc} but only {n} GPU{' is' if n == 1 else 's are'} visible; "
                        "use --nproc <= that, or --device cpu")


def continuing_nproc(run_dir, device: str, adopt: bool,
                     saved_world: int | None = None) -> tuple[int | None, str]:
    """A run continued from its config.json (or its checkpoints' URL) without --nproc, not
    under a launcher: with `adopt` (`--run-dir R` without --data), the number of processes it
    last trained on (configs.jsonl; else `saved_world`, its newest checkpoint's, for a run dir
    new on this machine), when more than one and this machine can start them (on CUDA, a GPU
    each); else None. And the line that says why, when that is not what it last trained on."""
    world = RunDir(run_dir).last_world_size() or saved_world
    if world is None or world == 1 or detect().world_size > 1 or under_launcher():
        return None, ""
    last = f"ddpgpt: run {run_dir} last trained on {world} processes"
    if not adopt:
        return None, f"{last}; given --data, this start runs on 1 (--nproc {world} for {world})"
    if device != "cpu" and torch.cuda.is_available() and world > torch.cuda.device_count():
        return None, (f"{last}, more than this machine's {torch.cuda.device_count()} GPUs: "
                      "continuing on 1 process (--nproc N, or torchrun, for more)")
    return world, (f"ddpgpt: continuing run {run_dir} on {world} processes, as it last trained "
                   "(--nproc N for another number)")


def train(cfg: TrainConfig, nproc: int, max_restarts: int, note: str = "") -> int:
    """Checks, locks and starts `nproc` training workers; returns the exit code. `note`: lines
    to say before they start (what the command line made of the config, why this many)."""
    check_nproc(nproc, cfg.run.device)
    cfg, dataset = preflight(cfg, nproc, nproc)
    for_run(cfg.run)  # bad task files: one line here, before the run dir is touched
    run_dir = RunDir(cfg.run.dir, cfg.run.checkpoint_url)
    run_dir.check_creatable()
    cfg, first = resume.plan(cfg, run_dir, dataset)
    if resume.report_finished(cfg, run_dir, first):  # no worker needed to find that out
        return 0
    with run_dir.locked():  # held: another run's lock is the one line, before any note
        if note:
            print(note, file=sys.stderr)
        run_dir.write_config(cfg.to_dict(), first.step, nproc)
        started = time.time()
        code, stopped_by = start(nproc, ["train", "--resolved-config", str(run_dir.config),
                                         *worker_flags(cfg)], max_restarts)
        if stopped_by is None:
            return code
        hint = resume_hint(cfg.run.resume, str(run_dir))
        if stop_checkpoint(run_dir, since=started) is not None:
            return EXIT_PREEMPTED  # rank 0 named the signal, the step and the checkpoint
        found = store.find_latest(run_dir.checkpoints)
        newest = f"the newest complete one is {found[0]}" if found else "there is none yet"
        print(f"ddpgpt: stopped by {stopped_by.name} before the workers could write a checkpoint; "
              f"{newest}: {hint}", file=sys.stderr)
        return 128 + stopped_by.value


def worker_flags(cfg: TrainConfig) -> list[str]:
    """What the workers take as flags beside config.json: what belongs to this start and not to
    the run (config.io.START_FIELDS, set back to their defaults in the file), and the schedule's
    end as resume.settle decided it here. A flag is a setting given: without it, a decay_steps
    equal to run.steps would be taken for the `auto` it may have come from (config.io.continued)
    and settled again by each worker, to the checkpoint's end, whatever this command gave."""
    return [*start_flags(cfg), "--optim.decay-steps", str(cfg.optim.decay_steps)]


def start_flags(cfg: TrainConfig) -> list[str]:
    """This start's own settings (config.io.START_FIELDS) as flags for its workers, which
    read the rest from config.json (where they are set back to their defaults)."""
    out = []
    for section, names in START_FIELDS.items():
        for name in names:
            value = getattr(getattr(cfg, section), name)
            if value != "":  # an empty setting (no data.cache) needs no flag
                out += [f"--{section}.{name.replace('_', '-')}",
                        str(value).lower() if isinstance(value, bool) else str(value)]
    return out


def stop_checkpoint(run_dir: RunDir, since: float):
    """The checkpoint the workers wrote on a stop request after `since`, if they did."""
    found = store.find_latest(run_dir.checkpoints)
    if found and found[1].get("reason") == "stop" and found[1].get("saved_at", 0) >= since:
        return found[0]
    return None


class _WorkerFailed(logging.Filter):
    """Drops the agent's "failed (exitcode: N) local_rank: R (pid: P) of binary: ..." line: a
    worker that exits non-zero has said why in one line, and one killed by a signal is named
    by `start` (a line of ours); the line after it is noise, on every input error."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("failed (exitcode: ")


def quiet_agent() -> None:
    """The elastic agent's warnings ("Sending process N closing signal SIGINT", ...) narrate
    what ddpgpt reports itself in one line; its errors still show, but for its line on a failed
    worker, which ddpgpt reports itself too. Its loggers set their own level when created, so
    each is lowered to ERROR here, after the imports that create them."""
    import torch.distributed.elastic.agent.server.api  # noqa: F401  (creates the loggers)
    import torch.distributed.elastic.multiprocessing.api  # noqa: F401
    import torch.distributed.run  # noqa: F401

    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed"):
            logger = logging.getLogger(name)
            logger.setLevel(logging.ERROR)
            if not any(isinstance(f, _WorkerFailed) for f in logger.filters):
                logger.addFilter(_WorkerFailed())


def start(nproc: int, worker_args: list[str],
          max_restarts: int = 0) -> tuple[int, signal.Signals | None]:
    """Runs `python ENTRY WORKER_ARGS` (ddpgpt, this package's) on `nproc` local processes;
    returns (exit code, the signal that stopped the launcher, if one did)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    # Workers set their own thread count (run.threads); this also silences torchrun's banner.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    quiet_agent()
    args = parse_args(["--standalone", f"--nproc-per-node={nproc}",
                       f"--max-restarts={max_restarts}",
                       "--monitor-interval=0.5", ENTRY, *worker_args])
    try:
        run(args)
    except SignalException as e:
        # The agent forwarded the signal to every worker and waited for them to stop: each
        # stops at its next step boundary and checkpoints first (see guard/health.py).
        return 128 + e.sigval.value, e.sigval
    except ChildFailedError as e:
        local_rank, failure = e.get_first_failure()
        if failure.exitcode > 0:  # the worker said why itself
            return failure.exitcode, None
        name = signal.Signals(-failure.exitcode).name
        print(f"ddpgpt: a worker was killed by {name} (local rank {failure.local_rank}); the group "
              "was stopped", file=sys.stderr)
        return 128 - failure.exitcode, None
    return 0, None

"""Elastic jobs: a run that goes on when nodes leave or join (`torchrun --nnodes MIN:MAX`).

    torchrun --nnodes 1:4 --nproc-per-node 8 --max-restarts 3 --rdzv-backend c10d \\
        --rdzv-endpoint HOST:29500 --rdzv-id job1 --rdzv-conf last_call_timeout=5 \\
        -m ddpgpt train --config run.toml                            # on every node

torchrun's elastic agents restart the whole group whenever its membership changes: a node dies
(the survivors' collectives fail; that costs each survivor one of its --max-restarts), or a node
joins (its agent waits; the running agents stop their workers with SIGTERM, which costs nothing).
Every restart is a new start of `ddpgpt train` at the new world size W. What ddpgpt adds:

1. The same batches at any W. G is fixed; A = G / (W·b) must divide for every W the range allows,
   and a G that does not is refused at the job's start (preflight.check_world_sizes), not at the
   first restart that reaches such a W.
2. A restart continues from the newest complete checkpoint on the loader's global cursor: the
   windows the full group would have read next. A node's death costs the steps since then.
3. A stop signal makes every rank checkpoint after the same step (guard/health.py), so a node that
   joins costs no step: the larger group continues from that checkpoint.
4. First-start rules (`--reset`, `--resume never`, `--resume PATH`) apply once per job. torch's
   store, where the attempt number lives (group._attempt), is hosted by one node's agent and is
   lost with that node, so the run dir records the job's launchers instead (job.json): a start is
   the job's first unless one of its launchers has started it before. A new `torchrun` on every
   node is a new job; a restart always has at least one surviving launcher.
"""

from __future__ import annotations

import dataclasses

from ddpgpt.checkpoint import store, swap
from ddpgpt.config.schema import TrainConfig
from ddpgpt.data.shards import TokenDataset
from ddpgpt.distributed import collectives
from ddpgpt.distributed.group import DistEnv
from ddpgpt.errors import say
from ddpgpt.run import resume
from ddpgpt.run.run_dir import RunDir


def first_start(run_dir: RunDir, env: DistEnv) -> tuple[bool, set[str]]:
    """(whether this is the job's first start, every rank's launcher). Collective. Rank 0
    decides from job.json and every rank takes its answer (nodes that see different run dirs
    are named later by setup's agreement check)."""
    launchers = set(filter(None, collectives.all_gather_text(env, env.launcher)))
    answer = None
    if env.is_main:  # no launcher (one process, or ranks started by hand): nothing can restart
        answer = "first" if not launchers & run_dir.known_launchers() else "restart"
    return collectives.all_gather_text(env, answer)[0] == "first", launchers


def claim(run_dir: RunDir, cfg: TrainConfig, env: DistEnv, dataset: TokenDataset,
          planned: tuple[TrainConfig, resume.Start] | None = None
          ) -> tuple[TrainConfig, resume.Start, DistEnv]:
    """The run dir for this run, and where it starts; `env` with its `first_start` set. Every
    rank decides where it starts, once (resume.plan, every file of the checkpoint hashed), before
    anything is written: bad input fails there, on every rank. Then rank 0 takes the lock
    (unless the `--nproc` launcher that started it holds it), applies that decision's first-start
    rules (--reset, or a rewind for --resume PATH), records the job's launchers and removes
    temporaries of interrupted saves; the rules leave the decision as it was (a reset starts
    from scratch, a rewind moves only checkpoints after the one it resumes). `planned`: the
    decision a lone process (no launcher: always its job's first start) has taken already."""
    first, launchers = first_start(run_dir, env)
    env = dataclasses.replace(env, first_start=first)
    settled, start = planned or collectives.together(env, lambda: resume.plan(
        cfg, run_dir, dataset, first, verify=True, quiet=not env.is_main))

    def take() -> None:
        # A restart may find the lock still held by the rank 0 of a node that left (a network
        # filesystem frees it when that node's lease runs out); the other ranks wait meanwhile,
        # at most run.dist_timeout_s, in the collective that ends `together`.
        run_dir.lock(allow_parent=True, wait_s=0 if first else cfg.run.dist_timeout_s / 2)
        # before anything is written at a checkpoint URL: one job at a time trains into it
        run_dir.take_lease(not first, cfg.run.take_over, cfg.run.lease_stale_s)
        if first and (cfg.run.resume == "reset" or start.over):
            run_dir.reset(start.over or "--reset")
        else:
            if start.set_aside:
                run_dir.rewind(start.set_aside, start.step)
            resume.set_abandoned_aside(run_dir, start)  # a rollback a kill interrupted
        for line in swap.repair(run_dir.checkpoints):  # a re-save cut while swapped in
            say(line)
        store.remove_temporaries(run_dir.checkpoints)
        if launchers:  # after the rules: a start that dies before this applies them again
            run_dir.record_job(launchers, first)

    collectives.together(env, take, main_only=True)
    # The plan may have found a step in a swap's copy: repaired, it is the step's own directory.
    return settled, dataclasses.replace(start, path=swap.in_place(start.path)), env

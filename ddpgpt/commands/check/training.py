"""Runs the matrix's training cases in this process, on the process group it is in (a group of
one at W=1, so every sync mode runs its own collectives and hooks), and turns them into rows.

Each case is a Trainer built from the check's small config and stepped as the training loop steps
it (train_step, then update); the per-step losses are the global means over the ranks."""

from __future__ import annotations

import dataclasses
import statistics
import time
import traceback

import torch

from ddpgpt.commands.check import matrix
from ddpgpt.commands.check.matrix import Case, Spec
from ddpgpt.commands.check.report import FAIL, NOT_RUN, PASS, Row, rel_diff, within
from ddpgpt.config.io import build
from ddpgpt.distributed import collectives
from ddpgpt.distributed.group import DistEnv
from ddpgpt.guard.health import Guard, StopSignal
from ddpgpt.model import flex
from ddpgpt.optim.schedule import Schedule
from ddpgpt.run.preflight import preflight
from ddpgpt.sync.modes import MODES
from ddpgpt.trainer import Trainer

MICRO_BATCH = 4
# The rows' model: small enough that a case takes a fraction of a second on a CPU core.
MODEL = {"n_layer": 2, "n_head": 2, "n_embd": 64, "block_size": 64}
SPEED = {"cpu": ("tiny", 8, 1, 3), "cuda": ("gpt2-124m", 8, 3, 10)}  # preset, b, warmup, timed
QUICK_SPEED = {"cpu": ("tiny", 8, 1, 1), "cuda": ("gpt2-124m", 8, 2, 5)}


@dataclasses.dataclass
class Result:
    losses: list[float] = dataclasses.field(default_factory=list)
    skipped: bool | None = None     # the forced non-finite step left the weights as they were
    tokens_per_s: float = 0.0
    peak_bytes: int = 0
    floor_bytes: int = 0            # what the mode table says weights, grads and state take
    error: str = ""
    needs: str = ""                 # what this machine lacks to run the case


def global_batch(nproc: int) -> int:
    """G for every W of the check: A = 2 at the largest W, 2·W at W=1."""
    return 2 * MICRO_BATCH * nproc


def config(case: Case, env: DistEnv, data: str, nproc: int, quick: bool):
    """The resolved training config of `case` at env's W (the oracle: W=1, CPU, fp32)."""
    run = {"dir": "check-run", "device": env.device.type, "sync": case.mode or "ddp",
           "precision": case.precision, "compile": case.compile, "grad_compress": case.compress}
    if case.speed:
        preset, b, _, _ = (QUICK_SPEED if quick else SPEED)[env.device.type]
        # G = b·nproc at every W (A = nproc / W): the oracle's batch is the group's
        flags = {"data": {"dir": data, "micro_batch": b, "global_batch": b * nproc,
                          "verify": False}, "run": run}
        return preflight(build(preset, None, flags), env.world_size, env.local_world_size)
    flags = {"model": {**MODEL, "arch": case.arch, "attention": case.attention},
             "data": {"dir": data, "micro_batch": MICRO_BATCH, "global_batch": global_batch(nproc),
                      "verify": False, "align": case.align},
             "optim": {"name": case.optim, "lr": 1e-2, "warmup_steps": 1},
             "run": run}
    return preflight(build(None, None, flags), env.world_size, env.local_world_size)


def train(case: Case, env: DistEnv, data: str, nproc: int, quick: bool) -> Result:
    """One case, start to end; a failure becomes the result's error (the other rows go on)."""
    oracle = DistEnv(device=torch.device("cpu"))  # one process, no group
    env = oracle if case.mode is None else env
    if case.torch_hook and env.backend != "nccl":
        return Result(needs="NCCL")
    if case.attention == "flex" and lacking(env.device.type):
        return Result(needs=lacking(env.device.type))
    try:
        cfg, dataset = config(case, env, data, nproc, quick)
        # The small model's 64-wide matmuls gain nothing from a second CPU thread, and lose much
        # on a busy machine (two cases of a test: 34 s with 2 threads, 0.9 s with 1, measured on
        # a shared 2-core VM); the speed model takes the run's own count.
        torch.set_num_threads(cfg.run.threads if case.speed else 1)
        trainer = Trainer(cfg, env, dataset, Guard(env, cfg.run, StopSignal(announce=False)),
                          local=case.mode is None)
        if case.torch_hook:
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            trainer.sync.model.register_comm_hook(None, default_hooks.bf16_compress_hook)
    except Exception as e:  # noqa: BLE001 -- a row's failure is reported, not raised
        return Result(error=error_line(e))
    try:
        return (timed if case.speed else stepped)(trainer, case, quick)
    except Exception as e:  # noqa: BLE001
        return Result(error=error_line(e))
    finally:
        trainer.close()
        if env.device.type == "cuda":
            torch.cuda.empty_cache()


def lacking(device: str) -> str:
    """What this torch lacks to train through FlexAttention on `device` ("" when nothing)."""
    if flex.unavailable():
        return f"FlexAttention (torch >= 2.5; this is torch {torch.__version__})"
    return ""


def error_line(e: Exception) -> str:
    frame = traceback.extract_tb(e.__traceback__)[-1] if e.__traceback__ else None
    where = f" ({frame.filename.rsplit('/', 1)[-1]}:{frame.lineno})" if frame else ""
    first = (str(e).strip().splitlines() or [""])[0][:160]
    return f"{type(e).__name__}: {first}{where}"


def global_loss(trainer: Trainer, loss: torch.Tensor) -> float:
    env = trainer.env
    return (collectives.all_reduce(env, loss.detach().float().clone()) / env.world_size).item()


def stepped(trainer: Trainer, case: Case, quick: bool) -> Result:
    """STEPS optimizer steps; step `skip_at` is forced non-finite: under fp16 its gradients
    overflow (the loss scale is raised to 2^40 for it) and the scaler must skip the update; the
    fp32 oracle skips it as the training loop skips a non-finite step."""
    result, schedule = Result(), Schedule(trainer.cfg.optim, matrix.STEPS)
    for k in range(matrix.STEPS):
        forced = k + 1 == case.skip_at
        if forced and trainer.scaler is not None:
            scale = trainer.scaler.get_scale()
            trainer.scaler.update(new_scale=2.0**40)
            before = collectives.state_digest(trainer.raw.state_dict())
        loss, _ = trainer.train_step()
        result.losses.append(global_loss(trainer, loss))
        if forced and trainer.scaler is None:
            trainer.skip_update()
        else:
            trainer.update(schedule.at(k))
        if forced and trainer.scaler is not None:
            lowered = trainer.scaler.get_scale() < 2.0**40
            after = collectives.state_digest(trainer.raw.state_dict())
            result.skipped = lowered and after == before
            trainer.scaler.update(new_scale=scale)
    return result


def timed(trainer: Trainer, case: Case, quick: bool) -> Result:
    """Warm-up steps, then timed ones: tokens/s from the median step (the slowest rank's); the
    peak memory of the device (CUDA), from the first timed step on. The oracle (the fp32 CPU
    run) only evaluates the first global batch: the first step's loss, before any update, is
    the one to compare, and a forward alone is a third of a step (gpt2-124m on the host's CPU)."""
    env, cfg = trainer.env, trainer.cfg
    _, _, warmup, steps = (QUICK_SPEED if quick else SPEED)[env.device.type]
    if case.mode is None:
        return Result(losses=[trainer.probe(0)])
    result, times, schedule = Result(), [], Schedule(cfg.optim, warmup + steps)
    for k in range(warmup + steps):
        if k == warmup and env.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(env.device)
        collectives.barrier(env)
        start = time.perf_counter()
        loss, _ = trainer.train_step()
        trainer.update(schedule.at(k))
        if env.device.type == "cuda":
            torch.cuda.synchronize(env.device)
        times.append(time.perf_counter() - start)
        result.losses.append(global_loss(trainer, loss))
    slowest = collectives.all_reduce(env, torch.tensor(statistics.median(times[warmup:])), op="max")
    result.tokens_per_s = cfg.data.global_batch * cfg.seq_len / slowest.item()
    params = sum(p.numel() for p in trainer.raw.parameters())  # a DTensor counts its whole
    result.floor_bytes = int(MODES[case.mode].memory(env.world_size, cfg.model.n_layer) * params)
    if env.device.type == "cuda":
        result.peak_bytes = int(collectives.all_reduce(
            env, torch.tensor(float(torch.cuda.max_memory_allocated(env.device)),
                              device=env.device), op="max").item())
    return result


def run_all(specs: list[Spec], env: DistEnv, data: str, nproc: int, quick: bool,
            progress=None) -> dict[Case, Result]:
    results = {}
    for case in matrix.cases(specs):
        start = time.perf_counter()
        results[case] = train(case, env, data, nproc, quick)
        result = results[case]
        if progress and not result.needs:
            progress(f"{case.name}: {time.perf_counter() - start:.1f} s"
                     + (f" ({result.error})" if result.error else ""))
    return results


def rows(specs: list[Spec], results: dict[Case, Result], device: str, world: int) -> list[Row]:
    return [row(spec, results, device, world) for spec in specs]


def row(spec: Spec, results: dict[Case, Result], device: str, world: int) -> Row:
    got = results[spec.case]
    want = results[spec.oracle] if spec.oracle else None
    for failed in (got, want):
        if failed is not None and failed.needs:
            return Row.needs(spec.check, device, world, spec.against, failed.needs)
        if failed is not None and failed.error:
            which = "its oracle: " if failed is want else ""
            return Row(spec.check, device, world, spec.against, which + failed.error, FAIL)
    if spec.kind == "speed":  # the oracle may hold only the first loss
        n = len(want.losses)
        r = within(spec.check, device, world, spec.against,
                   rel_diff(got.losses[:n], want.losses), spec.tol)
        r.figure = f"{got.tokens_per_s:,.0f} tokens/s; {r.figure}"
        return r
    if spec.kind == "memory":
        return memory_row(spec, got, want, device, world)
    r = within(spec.check, device, world, spec.against, rel_diff(got.losses, want.losses),
               spec.tol)
    if spec.case.skip_at and not got.skipped:
        r.status = FAIL
        r.figure += f"; step {spec.case.skip_at} was NOT skipped"
    elif spec.case.skip_at:
        r.figure += f"; step {spec.case.skip_at} skipped, weights unchanged"
    return r


def memory_row(spec: Spec, got: Result, want: Result | None, device: str, world: int) -> Row:
    """The peak the device allocated in the timed steps. It must hold at least what the mode
    table says the weights, gradients and AdamW state take (sync.MODES[mode].memory); a mode that
    shards the state must hold less than ddp at W > 1, any other mode at most 1.5 × ddp's."""
    if device != "cuda":
        return Row.needs(spec.check, device, world, spec.against, "CUDA memory statistics")
    mib, floor = got.peak_bytes / 2**20, got.floor_bytes / 2**20
    ok = 0 < floor <= mib
    figure = f"{mib:,.0f} MiB (table ≥ {floor:,.0f}"
    if want is not None:
        ddp = want.peak_bytes / 2**20
        limit = ddp if MODES[spec.case.mode].shards_state and world > 1 else 1.5 * ddp
        ok = ok and mib <= limit
        figure += f"; ddp {ddp:,.0f}, so ≤ {limit:,.0f}"
    return Row(spec.check, device, world, spec.against, figure + ")", PASS if ok else FAIL)


def not_run(specs: list[Spec], device: str, world: int, what: str) -> list[Row]:
    return [Row(s.check, device, world, s.against, f"needs {what}", NOT_RUN) for s in specs]

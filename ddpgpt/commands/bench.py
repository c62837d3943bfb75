"""`ddpgpt bench`: what each gradient-sync mode costs, on this machine or cluster.

    ddpgpt bench --nproc 2 --data data/stdlib                       # CPU: 2 gloo processes, tiny
    torchrun --standalone --nproc_per_node 8 -m ddpgpt bench --data data/fineweb --preset gpt2-124m
    ddpgpt bench --nproc 2 --sync ddp,zero1 --steps 20 --repeats 3 --out bench/
    ddpgpt bench --nproc 4 --optim muon             # Muon for the matrices, in every mode
    ddpgpt bench --device cuda --group --preset gpt2-124m      # one GPU: a one-rank NCCL group

For each mode, with the preset's batch (A micro-steps per step):
- the median step time (forward, backward, sync, clip, update) over `--steps` steps of each of
  `--repeats` rounds (the modes take turns, so a machine's drift does not favour one);
- the exposed communication: that time minus the median of the same steps with no collective
  at all (every rank computing its own micro-batches: the work that no mode can hide);
- the bytes each rank sends per step, computed for ring algorithms by the mode table's formula
  (sync/modes.py) from N, W, A and, under Muon, its matrices' layout by owner (not measured:
  DDP and FSDP2 run their collectives inside torch);
- the memory each rank holds for parameters, gradients and optimizer state (measured from the
  tensors; under Muon also how much of the state is Muon's momentum), and on CUDA the
  activations (peak allocated minus those).
The no-collective baseline steps Muon as the modes do, each rank its own matrices (1/W of the
Newton-Schulz work), so that work counts as compute, not as exposed communication.

Rank 0 prints a table and writes bench.json and, with matplotlib (`pip install 'ddpgpt[plot]'`),
bench.png.
"""

from __future__ import annotations

import json
import signal
import statistics
import sys
import time
from pathlib import Path

import torch

from ddpgpt.config.commands import BenchConfig
from ddpgpt.config.io import build
from ddpgpt.config.schema import TrainConfig
from ddpgpt.data.shards import TokenDataset
from ddpgpt.distributed import collectives
from ddpgpt.distributed.group import DistEnv, session
from ddpgpt.errors import UserError
from ddpgpt.files import describe, install, writable_dir
from ddpgpt.guard.health import Guard, StopSignal
from ddpgpt.optim.schedule import Schedule
from ddpgpt.run import launch
from ddpgpt.run.init_weights import apply_shape
from ddpgpt.run.precision import configure
from ddpgpt.run.preflight import preflight
from ddpgpt.sync.modes import MODES, Traffic
from ddpgpt.sync.modes import check as check_mode
from ddpgpt.trainer import Trainer


def traffic(trainer: Trainer, compress: bool = False) -> Traffic:
    """What the trainer's steps move: its model's parameters, W, A and, under Muon, its
    matrices and their layout by owner."""
    matrices = trainer.sync.matrices
    n = trainer.raw.num_params(non_embedding=False)  # a DTensor counts its whole tensor
    return Traffic(n, trainer.env.world_size, trainer.accum, 2 if compress else 4,
                   matrices=sum(r * c for r, c in matrices.shapes) if matrices else 0,
                   padded=matrices.layout.padded() if matrices else 0)


def time_steps(trainer: Trainer, warmup: int, steps: int) -> tuple[list[float], dict]:
    """Step times after `warmup` steps, and the memory held at the last step's fullest moment:
    after its gradients are synced, before the update (which may free them)."""
    times, schedule = [], Schedule(trainer.cfg.optim, warmup + steps)
    for k in range(warmup + steps):
        collectives.barrier(trainer.env)  # every rank starts the step together
        start = time.perf_counter()
        trainer.train_step()
        if k == warmup + steps - 1:
            counted = time.perf_counter()
            held = trainer.sync.memory(trainer.optimizer)
            start += time.perf_counter() - counted  # not part of the step
        trainer.update(schedule.at(k))
        if trainer.env.device.type == "cuda":
            torch.cuda.synchronize()
        if k >= warmup:
            times.append(time.perf_counter() - start)
    return times, held


def train_config(cfg: BenchConfig, world: int, local: int, mode: str | None,
                 device: str) -> tuple[TrainConfig, TokenDataset]:
    """The training config one mode is measured with (None: no collective at all), resolved and
    checked like `train`'s. Nothing is written: the run dir is never created."""
    flags = {"data": {"dir": cfg.data, "verify": False},
             "run": {"dir": "bench-run", "device": device, "sync": mode or "ddp"},
             **({"optim": {"name": cfg.optim}} if cfg.optim else {})}
    return preflight(build(cfg.preset, cfg.config, flags, shape=apply_shape), world, local)


def modes(cfg: BenchConfig) -> list[str]:
    """The modes to measure: --sync's, each a row of the table, or every row."""
    names = cfg.sync.split(",") if cfg.sync else list(MODES)
    for name in names:
        check_mode(name, "bench.sync")
    return names


def check(cfg: BenchConfig, world: int, local: int) -> Path:
    """Everything bench can know before measuring, once, where it is started (the `--nproc`
    launcher, or this process): every mode's config at this world size, and the output
    directory (created here). Bad input is one line before any worker starts."""
    for mode in [None, *modes(cfg)]:
        train_config(cfg, world, local, mode, cfg.device)
    return writable_dir(Path(cfg.out))


def measure(cfg: BenchConfig, env: DistEnv, mode: str | None) -> dict:
    """One mode (None: no collective at all) on a fresh trainer: its step times."""
    train_cfg, dataset = train_config(cfg, env.world_size, env.local_world_size, mode,
                                      env.device.type)
    configure(train_cfg.run.threads, env.device)
    guard = Guard(env, train_cfg.run, StopSignal(announce=False))
    trainer = Trainer(train_cfg, env, dataset, guard, local=mode is None)
    n = traffic(trainer).params
    if env.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(env.device)
    times, held = time_steps(trainer, cfg.warmup, cfg.steps)
    sent = MODES[mode].sent(traffic(trainer)) if mode else 0
    if env.device.type == "cuda":
        held["activations"] = torch.cuda.max_memory_allocated(env.device) - sum(held.values())
    runs_as = type(trainer.sync).__name__  # Sync: no collective at all
    model = describe_model(train_cfg, trainer.raw.num_params(non_embedding=False))
    trainer.close()  # lets go of the model and optimizer
    return {"mode": mode or "no sync", "runs_as": runs_as, "times": times, "sent_bytes": int(sent),
            "memory": held, "accum": trainer.accum, "params": n, "model": model}


def describe_model(cfg: TrainConfig, params: int) -> str:
    """What was measured, whatever preset or file set it: shape, size and optimizer."""
    m = cfg.model
    return f"{m.n_layer} layers × {m.n_embd} wide, {params / 1e6:.2f}M parameters, {cfg.optim.name}"


def run(cfg: BenchConfig) -> None:
    if cfg.nproc:
        launch.check_nproc(cfg.nproc, cfg.device)
        check(cfg, cfg.nproc, cfg.nproc)
        args = ["bench"]
        for key, value in vars(cfg).items():
            flag = key.replace("_", "-")
            if isinstance(value, bool):
                args.append(f"--{flag}" if value else f"--no-{flag}")
            elif key != "nproc" and value is not None:
                args.append(f"--{flag}={value}")
        sys.exit(launch.start(cfg.nproc, args)[0])
    order = [None, *modes(cfg)]
    with session(cfg.device, group_at_one=cfg.group) as env, \
            StopSignal(announce=False) as stop:
        collectives.together(env, lambda: check(cfg, env.world_size, env.local_world_size))
        if env.is_main:
            print(f"ddpgpt bench: measuring {len(order)} modes ({', '.join(order[1:])} "
                  f"and no sync) × {cfg.repeats} round{'s' if cfg.repeats > 1 else ''} on "
                  f"{env.world_size} process{'es' if env.world_size > 1 else ''}; Ctrl-C stops "
                  "after the mode being measured and reports what was", file=sys.stderr,
                  flush=True)
        measured: dict[str | None, list[dict]] = {}
        for _ in range(cfg.repeats):
            for mode in order:
                measured.setdefault(mode, []).append(measure(cfg, env, mode))
                if agreed_stop(env, stop):
                    break
            else:
                continue
            break
        rows = summarize(env, measured)
        if env.is_main:
            report(cfg, env, rows, stopped=stop.name if stop.requested else None,
                   total=len(order))
        if stop.requested:
            raise BenchStopped(f"bench stopped by {stop.name or 'a signal to another rank'} "
                               f"after measuring {len(measured)} of {len(order)} modes; the "
                               f"table above and {Path(cfg.out) / 'bench.json'} hold them",
                               quiet=not env.is_main, signum=stop.signum)


class BenchStopped(UserError):
    """Stopped by a signal after the mode being measured; what was measured is reported."""

    label = "stopped"

    def __init__(self, message: str, quiet: bool, signum: int | None):
        super().__init__(message, quiet=quiet)
        self.exit_code = 128 + (signum or signal.SIGTERM)


def agreed_stop(env: DistEnv, stop: StopSignal) -> bool:
    """Whether any rank was asked to stop: every rank leaves after the same mode."""
    flag = torch.tensor([float(stop.requested)], device=env.device)
    return bool(collectives.all_reduce(env, flag, op="max").item())


def summarize(env: DistEnv, measured: dict) -> list[dict]:
    """One row per mode measured: the median step over its rounds, of the slowest rank (a step
    is as slow as its slowest rank), and what is exposed against no sync."""
    rows = []
    for results in measured.values():
        row = {k: v for k, v in results[-1].items() if k != "times"}
        row["step_s"] = statistics.median(t for r in results for t in r["times"])
        rows.append(row)
    slowest = collectives.all_reduce(env, torch.tensor([r["step_s"] for r in rows]), op="max")
    for row, step_s in zip(rows, slowest.tolist()):
        row["step_s"], row["exposed_s"] = step_s, max(0.0, step_s - slowest[0].item())
    return rows


def report(cfg: BenchConfig, env: DistEnv, rows: list[dict], stopped: str | None = None,
           total: int = 0) -> None:
    """The table first (it survives a failed write), then bench.json and bench.png."""
    mb = 2**20
    what = cfg.preset + (f" + {cfg.config}" if cfg.config else "")
    print(f"ddpgpt bench: {env.world_size} process{'es' if env.world_size > 1 else ''}, "
          f"{env.device.type} ({env.backend or 'no group'}), {what}: {rows[0]['model']}, "
          f"A={rows[0]['accum']}; medians of {cfg.steps * cfg.repeats} steps"
          + (f" in {cfg.repeats} rounds" if cfg.repeats > 1 else "")
          + (f"; stopped by {stopped} after {len(rows)} of {total} modes" if stopped else ""))
    muon = "muon_state" in rows[0]["memory"]  # and how much of the state is Muon's momentum
    print(f"{'mode':10s} {'step ms':>9s} {'exposed ms':>11s} {'sent MB/step':>13s} "
          f"{'params MB':>10s} {'grads MB':>9s} {'state MB':>9s}" + (" of which Muon MB"
                                                                      if muon else ""))
    for r in rows:
        m = r["memory"]
        print(f"{r['mode']:10s} {r['step_s'] * 1e3:9.1f} {r['exposed_s'] * 1e3:11.1f} "
              f"{r['sent_bytes'] / mb:13.2f} {m['params'] / mb:10.2f} {m['grads'] / mb:9.2f} "
              f"{m['state'] / mb:9.2f}" + (f" {m['muon_state'] / mb:17.2f}" if muon else ""),
              flush=True)
    out = Path(cfg.out)
    where = {"world_size": env.world_size, "device": env.device.type, "backend": env.backend,
             "preset": cfg.preset, "config": cfg.config, "muon": muon, "model": rows[0]["model"],
             "torch": torch.__version__, "steps": cfg.steps, "repeats": cfg.repeats,
             "stopped_by": stopped}
    try:
        (out / "bench.json").write_text(json.dumps({**where, "rows": rows}, indent=1) + "\n")
        png = plot(rows, out / "bench.png", f"W={env.world_size}, {env.device.type}, {what}")
    except OSError as e:
        raise UserError(f"cannot write the results into --out {out}: {describe(e)}; the table "
                        "above holds them") from None
    print(f"wrote {out / 'bench.json'}" + (f" and {png}" if png else
                                           f" (no chart: {install('plot')} for bench.png)"))


def plot(rows: list[dict], path: Path, title: str) -> Path | None:
    """Step time (compute and exposed communication) and memory per rank, per mode; None
    without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = [r["mode"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    compute = [(r["step_s"] - r["exposed_s"]) * 1e3 for r in rows]
    left.bar(modes, compute, label="compute")
    left.bar(modes, [r["exposed_s"] * 1e3 for r in rows], bottom=compute,
             label="exposed communication")
    left.set_ylabel("ms per step (slowest rank)")
    left.legend()
    bottom = [0.0] * len(rows)
    for part in ("params", "grads", "state", "activations"):
        values = [r["memory"].get(part, 0) / 2**20 for r in rows]
        if any(values):
            right.bar(modes, values, bottom=bottom, label=part)
            bottom = [b + v for b, v in zip(bottom, values)]
    right.set_ylabel("MB per rank")
    right.legend()
    for axis in (left, right):
        axis.tick_params(axis="x", rotation=30)
    fig.suptitle(f"ddpgpt bench: {title}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

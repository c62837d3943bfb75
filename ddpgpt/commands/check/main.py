"""`ddpgpt check`: every path of ddpgpt against its oracle, on the hardware at hand; one table.

    ddpgpt check                          # the device here (CUDA when available), full matrix
    ddpgpt check --device cpu --quick     # a subset: 2.7 CPU minutes on a 2-core CPU
    make device-check                     # sets up .venv, then the full matrix

Rows (matrix.py says what each is compared with, and how closely):
1. every sync mode at W=1 (a process group of one: each mode's own collectives and hooks run)
   and at W=2 (gloo on CPU) or one process per GPU; fp32 and bf16; AdamW and Muon; with and
   without torch.compile; gradient compression; fp16 with its loss scaler and a forced
   non-finite step; tokens/s and peak memory per mode; rows that start at documents trained
   through FlexAttention against SDPA's dense mask (training.py);
2. FlexAttention's block mask against SDPA's dense mask (documents, the sliding band, grouped-
   query heads: logits and gradients), and its time against unmasked causal attention at
   T=1,024 (attention.py);
3. the commands, as a user runs them (commands.py): a checkpoint written on this device resumed
   on the CPU and the reverse, a stop by SIGTERM (exit 75) resumed bitwise, `eval`, `sample` and
   `export` of a checkpoint of this device.
A row that needs what this machine lacks (CUDA memory statistics, a second GPU, transformers,
FlexAttention, CUDA for a GPU kernel's speed goal) says so; it never passes. device-check.md and
device-check.json go to --out; the exit code is 1 when any row fails.

Under torchrun (or as the workers this command starts for W > 1) it runs the training rows at
that world size and rank 0 writes them to OUT/rows-wN.json.
"""

from __future__ import annotations

import contextlib
import fnmatch
import io
import json
import os
import sys
import sysconfig
import time
from pathlib import Path

import torch

from ddpgpt.commands.check import attention, commands, matrix, training
from ddpgpt.commands.check.report import (
    FAIL,
    NOT_RUN,
    Row,
    counts,
    environment,
    header,
    table,
    took,
    took_text,
    write,
)
from ddpgpt.config.commands import CheckConfig, PrepareConfig
from ddpgpt.data.shards import TokenDataset
from ddpgpt.distributed.group import DistEnv, detect, session
from ddpgpt.errors import UserError
from ddpgpt.files import writable_dir
from ddpgpt.run import launch
from ddpgpt.run.precision import configure

# Standard-library modules in every Python >= 3.10: ~0.8 MB of text, 600+ windows of 1,024 tokens
# (the CUDA speed rows' sequences) after the validation split.
CORPUS = ("argparse.py", "typing.py", "inspect.py", "dataclasses.py", "difflib.py",
          "functools.py", "textwrap.py", "shlex.py", "bisect.py", "heapq.py", "fnmatch.py",
          "glob.py", "colorsys.py", "keyword.py")


class CheckFailed(UserError):
    label = "check failed"
    exit_code = 1


def run(cfg: CheckConfig) -> None:
    if detect().world_size > 1:
        group_rows(cfg)
        return
    started = time.perf_counter()
    device = resolve(cfg.device)
    out = prepare_out(Path(cfg.out))
    data = cfg.data or prepare_data(out / "data")
    TokenDataset(data)  # a --data that is not a dataset: one line now, not a failure per row
    nproc = cfg.nproc or (2 if device == "cpu" else torch.cuda.device_count())
    say(f"ddpgpt check: {scope(cfg)} on {device}; W=1 and "
        f"W={max(nproc, 2)}; the runs go to {out}")
    rows: list[Row] = []
    with session(device, group_at_one=True) as env:   # 1. W=1: a group of one
        configure(max(1, len(os.sched_getaffinity(0))), env.device)
        env_info = environment(env.device)
        say(header(env_info))
        if selected(cfg, "loader copy"):
            rows.append(commands.loader_row(env, data))
        rows += training_rows(cfg, env, data, max(nproc, 2), say)
    rows += several(cfg, device, out, data, nproc)           # 2. W > 1: one process per device
    rows += attention.rows(device, lambda check: selected(cfg, check), say)  # 3. FlexAttention
    rows += commands.rows(device, data, out, lambda check: selected(cfg, check), say)  # 4.
    spent = took(time.perf_counter() - started)
    print(f"{header(env_info)}\n\n{table(rows)}\n\n{counts(rows)}; {took_text(spent)}",
          flush=True)
    paths = write(out, env_info, rows, scope(cfg), spent)
    print(f"wrote {paths[0]} and {paths[1]}")
    failed = [r.check for r in rows if r.status == FAIL]
    if failed:
        raise CheckFailed(f"{len(failed)} of {len(rows)} rows failed ({', '.join(failed[:3])}"
                          f"{', ...' if len(failed) > 3 else ''}); see {paths[0]}")


def scope(cfg: CheckConfig) -> str:
    what = "quick subset" if cfg.quick else "full matrix"
    what += "" if cfg.compile else ", no compile"
    return what + (f", rows matching {cfg.only}" if cfg.only else "")


def selected(cfg: CheckConfig, check: str) -> bool:
    """Whether --only lets row `check` run."""
    return not cfg.only or any(fnmatch.fnmatchcase(check, p.strip())
                               for p in cfg.only.split(","))


def plan(cfg: CheckConfig, device: str, world: int) -> list[matrix.Spec]:
    return [s for s in matrix.plan(device, world, cfg.quick) if selected(cfg, s.check)]


def training_rows(cfg: CheckConfig, env: DistEnv, data: str, nproc: int, say_) -> list[Row]:
    """The training rows at env's W; the compile rows as left out under --no-compile."""
    specs = plan(cfg, env.device.type, env.world_size)
    run = [s for s in specs if cfg.compile or not s.case.compile]
    results = training.run_all(run, env, data, nproc, cfg.quick, say_)
    done = dict(zip(run, training.rows(run, results, env.device.type, env.world_size)))
    return [done.get(s) or Row(s.check, env.device.type, env.world_size, s.against,
                               "left out by --no-compile", NOT_RUN) for s in specs]


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def resolve(device: str) -> str:
    if device == "cuda" and not torch.cuda.is_available():
        raise UserError("check --device cuda: no CUDA device is visible to torch "
                        f"{torch.__version__} (CUDA build: {torch.version.cuda or 'none'}); "
                        "install a CUDA build of torch, or use --device cpu")
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def prepare_out(out: Path) -> Path:
    return writable_dir(out).resolve()


def prepare_data(path: Path) -> str:
    """A small byte-level dataset from the standard library, prepared once. prepare's own
    report (and its advice on a val split of 3 documents) is about data the user did not ask
    for: one line says where it is instead."""
    if not (path / "meta.json").exists():
        from ddpgpt.data.prepare import main as prepare

        stdlib = Path(sysconfig.get_paths()["stdlib"])
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            prepare.run(PrepareConfig(sources=[str(stdlib / f) for f in CORPUS], out=str(path),
                                      tokenizer="byte", val_fraction=0.2, force=True))
        say(f"ddpgpt check: its data: {len(CORPUS)} standard-library modules as bytes, in {path}")
    return str(path)


def several(cfg: CheckConfig, device: str, out: Path, data: str, nproc: int) -> list[Row]:
    """The training rows at W = nproc, from workers this command starts (launch.start)."""
    world = max(nproc, 2)
    specs = plan(cfg, device, world)
    if not specs:
        return []
    if nproc < 2:
        return training.not_run(specs, device, world, "a second GPU")
    launch.check_nproc(nproc, device)
    found = out / f"rows-w{nproc}.json"
    found.unlink(missing_ok=True)
    # --flag=value: torchrun's own parser would take some flags for abbreviations of its own
    args = ["check", f"--device={device}", f"--out={out}", f"--data={data}",
            f"--only={cfg.only}", "--quick" if cfg.quick else "--no-quick",
            "--compile" if cfg.compile else "--no-compile"]
    say(f"ddpgpt check: starting {nproc} processes for the W={nproc} rows")
    code, _ = launch.start(nproc, args)
    try:
        return [Row(**r) for r in json.loads(found.read_text())]
    except (OSError, ValueError, TypeError):
        return [Row(s.check, device, world, s.against,
                    f"the W={world} workers wrote no rows (exit code {code})", FAIL)
                for s in specs]


def group_rows(cfg: CheckConfig) -> None:
    """A worker: the training rows at this group's world size; rank 0 writes them."""
    with session(cfg.device, timeout_s=300) as env:
        configure(max(1, len(os.sched_getaffinity(0)) // env.local_world_size), env.device)
        rows = training_rows(cfg, env, cfg.data, env.world_size, say if env.is_main else None)
        if env.is_main:  # for the command that started this group; under torchrun, for you
            path = Path(cfg.out) / f"rows-w{env.world_size}.json"
            path.write_text(json.dumps([r.__dict__ for r in rows], indent=1))
            say(f"{table(rows)}\n\n{counts(rows)}; written to {path}")

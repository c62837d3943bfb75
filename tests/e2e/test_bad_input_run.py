"""The bad-input catalogue of the config, the run dir and the launch, end to end: for each
broken state (a config that cannot be, a run dir that cannot be written, a checkpoint that cannot
be resumed, a port or a GPU count the launch cannot use) the real command line exits non-zero
within seconds with exactly one line on stderr, "ddpgpt: error: " + what is wrong, where (file,
field or rank) and what to do; no traceback, nothing on stdout, and nothing written, overwritten or
deleted in the data dir or the run dir.

The rows and the check they go through: tests/e2e/bad_input_cases.py; the dataset:
tests/e2e/test_bad_input_data.py.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import shutil
import socket
from pathlib import Path

import pytest

from ddpgpt.errors import UserError
from tests.e2e.bad_input_cases import (
    Case,
    Ctx,
    E,
    check,
    copied,
    row,
    sha256,
    train,
    truncate_half,
)
from tests.helpers import tiny_train_args
from tests.in_process import run_in_process

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

# the only checkpoint of `trained_run`: 2 steps, checkpoint_every 3 -> the end
CKPT = "step_0000002"


@pytest.fixture(scope="module")
def trained_run(tiny_data, tmp_path_factory) -> Path:
    """A real run dir: 2 steps of the tiny model, one checkpoint (step 2). Cases copy it."""
    run = tmp_path_factory.mktemp("trained") / "run"
    r = run_in_process(*tiny_train_args(tiny_data, run, steps=2)[2:])
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [CKPT]
    return run


# ---- setups: each builds one broken state in ctx.tmp ---------------------------------------

def elastic_worker(ctx: Ctx) -> Case:
    """A worker of `torchrun --nnodes 1:4 --nproc-per-node 1`, as its environment says."""
    return dataclasses.replace(copied(ctx), env={"TORCHELASTIC_RUN_ID": "job", "PET_NNODES": "1:4"})


def toml_unknown_key(ctx: Ctx) -> Case:
    c = copied(ctx)
    (ctx.tmp / "run.toml").write_text("[optim]\nlr = 3e-4\nlearning_rate = 3e-4\n")
    return c


def with_run(ctx: Ctx) -> Case:
    """The dataset and a copy of `trained_run`."""
    c = copied(ctx)
    shutil.copytree(ctx.trained_run(), c.run)
    return c


def newer_checkpoint(ctx: Ctx) -> Case:
    c = with_run(ctx)
    meta = c.run / "checkpoints" / CKPT / "meta.json"
    values = json.loads(meta.read_text())
    values["format_version"] = 99
    meta.write_text(json.dumps(values, indent=1) + "\n")
    return c


def corrupt_checkpoint_meta(ctx: Ctx) -> Case:
    c = with_run(ctx)
    c.facts["error"] = truncate_half(c.run / "checkpoints" / CKPT / "meta.json")
    return c


def corrupt_run_config(ctx: Ctx) -> Case:
    """The run's config.json cut short: `train --run-dir R` alone starts from it."""
    c = with_run(ctx)
    c.facts["error"] = truncate_half(c.run / "config.json").removeprefix("JSONDecodeError: ")
    return c


def run_dir_below_a_file(ctx: Ctx) -> Case:
    c = copied(ctx)
    (ctx.tmp / "file").write_text("not a directory\n")
    return Case(ctx.tmp, c.data, ctx.tmp / "file" / "run")


def run_dir_is_a_file(ctx: Ctx) -> Case:
    c = copied(ctx)
    (ctx.tmp / "run").write_text("not a directory\n")
    return c


def run_dir_in_proc(ctx: Ctx) -> Case:
    """A place where mkdir fails: the reason depends on the user (root: ENOENT, else EACCES)."""
    c = copied(ctx)
    c.run = Path("/proc/ddpgpt-run")
    try:
        os.mkdir(c.run)
    except OSError as e:
        c.facts["reason"] = f"{e.strerror} ({errno.errorcode[e.errno]})"
    else:  # pragma: no cover
        os.rmdir(c.run)
        pytest.skip("/proc accepts directories here")
    return c


def other_dataset(ctx: Ctx) -> Case:
    """The trained run, resumed on a dataset of the same size but other contents (fingerprint)."""
    c = with_run(ctx)
    meta = json.loads((c.data / "meta.json").read_text())
    meta["source"]["specs"] = ["another corpus"]
    (c.data / "meta.json").write_text(json.dumps(meta))
    c.facts.update(old=sha256(ctx.tiny_data / "meta.json")[:12],
                   new=sha256(c.data / "meta.json")[:12], trained_on=ctx.tiny_data)
    return c


def port_in_use(ctx: Ctx) -> Case:
    """Rank 0 of 2 as torchrun would start it, with MASTER_PORT held by a listening socket."""
    c = copied(ctx)
    sock = ctx.stack.enter_context(socket.socket())
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    port = sock.getsockname()[1]
    c.env = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
             "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    c.facts["port"] = port
    return c


# ---- the catalogue ------------------------------------------------------------------------

CASES = [
    row("seq-len-above-block-size", copied,
        lambda c: train(c, data__seq_len=64, model__block_size=32),
        lambda c: f"{E}invalid config: data.seq_len = 64 exceeds model.block_size = 32; "
                  "set data.seq_len <= 32 (0: model.block_size) or raise model.block_size"),
    row("global-batch-indivisible", copied,
        lambda c: train(c, "--nproc", "2", data__global_batch=6),
        lambda c: f"{E}data.global_batch = 6 is not divisible by world size 2 × data.micro_batch "
                  "2 = 4; make the global batch a multiple of 4 or change the micro-batch"),
    row("global-batch-indivisible-elastic", elastic_worker, train,
        lambda c: f"{E}torchrun --nnodes 1:4 (1 process per node) lets the job restart at world "
                  "size 1, 2, 3, 4, but data.global_batch = 8 is not divisible by W × "
                  "data.micro_batch for W = 3; make the global batch a multiple of 24, or change "
                  "the micro-batch or the --nnodes range"),
    row("toml-unknown-key", toml_unknown_key, lambda c: train(c, "--config", c.tmp / "run.toml"),
        lambda c: f"{E}{c.tmp / 'run.toml'}: unknown key optim.learning_rate; "
                  "known: name, lr, min_lr, embed_lr, warmup_steps, decay_steps, schedule_start, "
                  "schedule, decay_fraction, weight_decay, beta1, beta2, eps, "
                  "grad_clip, muon_lr, muon_momentum, muon_momentum_start, muon_momentum_warmup, "
                  "muon_ns_steps, muon_ns, muon_eq, muon_snap, muon_ns_dtype"),
    row("cli-wrong-type", copied, lambda c: train(c, run__steps="ten"),
        lambda c: f"{E}command line: run.steps: expected an integer, got 'ten'"),
    row("cli-out-of-range", copied, lambda c: train(c, optim__warmup_steps=-1),
        lambda c: f"{E}invalid config: optim.warmup_steps = -1 must be >= 0"),
    row("bucket-mb-infinite", copied, lambda c: train(c, "--nproc", "2", run__bucket_mb="inf"),
        lambda c: f"{E}invalid config: run.bucket_mb = inf must be a finite number"),
    row("bucket-mb-huge", copied, lambda c: train(c, run__bucket_mb="1e13"),
        lambda c: f"{E}invalid config: run.bucket_mb = 1e+13 must be in (0, 65536] (MB per "
                  "gradient bucket)"),
    row("checkpoint-other-shape", with_run, lambda c: train(c, model__n_embd=64),
        lambda c: f"{E}run dir {c.run}: refused to resume checkpoint {CKPT}, which has another "
                  "model shape or optimizer (n_embd 32 -> 64); use another --run-dir, or "
                  "--reset to set the old run aside"),
    row("checkpoint-other-optimizer", with_run, lambda c: train(c, optim__name="muon"),
        lambda c: f"{E}run dir {c.run}: refused to resume checkpoint {CKPT}, which has another "
                  "model shape or optimizer (optim.name adamw -> muon); use another --run-dir, "
                  "or --reset to set the old run aside"),
    row("checkpoint-newer-format", newer_checkpoint, train,
        lambda c: f"{E}{c.run / 'checkpoints' / CKPT}: checkpoint format version 99 is newer "
                  "than this ddpgpt reads (3); upgrade ddpgpt (pip install -U ddpgpt)"),
    row("run-config-corrupt", corrupt_run_config, lambda c: ["train", "--run-dir", c.run],
        lambda c: f"{E}the run's config {c.run / 'config.json'}: not valid JSON "
                  f"({c.facts['error']}); restore it, or give the whole config (--preset, "
                  "--config)"),
    row("resolved-config-with-preset", with_run,
        lambda c: ["train", "--resolved-config", c.run / "config.json", "--preset", "tiny"],
        lambda c: f"{E}--resolved-config is a whole config; --preset does not go with it: give "
                  "one of them (flags override either)"),
    row("checkpoint-meta-corrupt", corrupt_checkpoint_meta, train,
        lambda c: f"{E}no valid checkpoint in {c.run}: "
                  f"{c.run / 'checkpoints' / CKPT / 'meta.json'}: corrupt meta.json "
                  f"({c.facts['error']}); move the bad ones away, or pass --reset to set them "
                  "aside and start over"),
    row("run-dir-below-a-file", run_dir_below_a_file, train,
        lambda c: f"{E}run dir {c.run}: {c.tmp / 'file'} is a file, not a directory; "
                  "give another --run-dir"),
    row("run-dir-is-a-file", run_dir_is_a_file, train,
        lambda c: f"{E}run dir {c.run} is a file; give a directory (--run-dir)"),
    row("run-dir-unwritable", run_dir_in_proc, train,
        lambda c: f"{E}run dir {c.run}: cannot create it: {c.facts['reason']}; "
                  "give a writable --run-dir"),
    row("resume-on-other-data", other_dataset, train,
        lambda c: f"{E}run dir {c.run}: checkpoint {CKPT} was trained on another dataset "
                  f"({c.facts['trained_on']}, fingerprint {c.facts['old']}) than data.dir = "
                  f"{c.data} (fingerprint {c.facts['new']}); pass its --data, --reset to start "
                  "over, or --data.allow-switch to go on with the new data"),
    row("rendezvous-port-in-use", port_in_use, lambda c: train(c, run__dist_timeout_s=20),
        lambda c: f"{E}rank 0: cannot open the rendezvous port 127.0.0.1:{c.facts['port']}: "
                  "address already in use; another job holds it: choose another MASTER_PORT / "
                  "--rdzv-endpoint port"),
]


@pytest.mark.parametrize(("setup", "command", "expected"), CASES)
def test_bad_input(setup, command, expected, tiny_data, tmp_path, request):
    check(setup, command, expected, tiny_data, tmp_path, request)


def test_nproc_above_visible_gpus(monkeypatch):
    """On CUDA, --nproc larger than the visible GPUs is refused before the launcher starts anyone;
    CPU workers (--device cpu) are not limited by the GPU count."""
    import torch

    from ddpgpt.run import launch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(UserError) as info:
        launch.check_nproc(2, "auto")
    assert str(info.value) == ("--nproc 2 but only 1 GPU is visible; use --nproc <= that, or "
                               "--device cpu")
    launch.check_nproc(2, "cpu")  # CPU workers: no limit

"""The bad-input catalogue, end to end: for each broken state the real command line exits non-zero
within seconds with exactly one line on stderr, "ddpgpt: error: " + what is wrong, where (file,
field or rank) and what to do; no traceback, nothing on stdout, and nothing written, overwritten or
deleted in the data dir or the run dir.

One row per case: an id, a setup that builds the broken state in tmp_path (from a copy of the
session's `tiny_data`, never the fixture itself), the command line and the expected line. Every
case exits with 2, the code for bad input.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import os
import shutil
import socket
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from ddpgpt.data.shards import HEADER_BYTES
from ddpgpt.errors import UserError
from tests.helpers import json_error, run_cli, tiny_train_args

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

# the only checkpoint of `trained_run`: 2 steps, checkpoint_every 3 -> the end
CKPT = "step_0000002"
SHARD = "train_000000.bin"
REPREPARE = "re-run ddpgpt prepare"


@dataclass
class Ctx:
    """What a setup may use: its own tmp dir, the shared dataset (to copy), fixtures on demand and
    an ExitStack for resources held while the command runs (a listening socket)."""

    tmp: Path
    tiny_data: Path
    request: pytest.FixtureRequest
    stack: ExitStack

    def trained_run(self) -> Path:
        return self.request.getfixturevalue("trained_run")


@dataclass
class Case:
    """The broken state: the --data and --run-dir of the command (either may not exist), the
    environment, and facts the expected line quotes (sizes, hashes, a parser's message, a port)."""

    tmp: Path
    data: Path
    run: Path
    env: dict = field(default_factory=dict)
    facts: dict = field(default_factory=dict)


def train(c: Case, *before: str | Path, **overrides) -> list:
    """`train [BEFORE...] <tiny_train_args for 2 steps>` with `overrides` replacing its flags."""
    return ["train", *before, *tiny_train_args(c.data, c.run, steps=2, **overrides)[3:]]


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def snapshot(root: Path) -> tuple[set[str], dict[str, tuple[int, str]]] | None:
    """(directories, {file: (size, sha256)}) under `root`, relative; None when it does not exist."""
    if not root.exists():
        return None
    paths = sorted(root.rglob("*"))
    dirs = {str(p.relative_to(root)) for p in paths if p.is_dir()}
    files = {str(p.relative_to(root)): (p.stat().st_size, sha256(p)) for p in paths if p.is_file()}
    return dirs, files


def train_tokens(c: Case) -> int:
    """Tokens in the dataset's train split, as its meta.json lists them."""
    return sum(s["tokens"]
               for s in json.loads((c.data / "meta.json").read_text())["shards"]["train"])


def truncate_half(path: Path) -> str:
    """Cuts a JSON file to its first half (a write cut short); returns the parse error it now
    has."""
    text = path.read_text()
    path.write_text(text[: len(text) // 2])
    return json_error(text[: len(text) // 2])


@pytest.fixture(scope="module")
def trained_run(tiny_data, tmp_path_factory) -> Path:
    """A real run dir: 2 steps of the tiny model, one checkpoint (step 2). Cases copy it."""
    run = tmp_path_factory.mktemp("trained") / "run"
    r = run_cli(*tiny_train_args(tiny_data, run, steps=2)[2:], timeout=120)
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [CKPT]
    return run


# ---- setups: each builds one broken state in ctx.tmp ---------------------------------------

def copied(ctx: Ctx) -> Case:
    """An intact copy of the dataset and a run dir that does not exist yet."""
    shutil.copytree(ctx.tiny_data, ctx.tmp / "data")
    return Case(ctx.tmp, ctx.tmp / "data", ctx.tmp / "run")


def elastic_worker(ctx: Ctx) -> Case:
    """A worker of `torchrun --nnodes 1:4 --nproc-per-node 1`, as its environment says."""
    return dataclasses.replace(copied(ctx), env={"TORCHELASTIC_RUN_ID": "job", "PET_NNODES": "1:4"})


def missing_dataset(ctx: Ctx) -> Case:
    return Case(ctx.tmp, ctx.tmp / "missing", ctx.tmp / "run")


def mixture_with_a_missing_dataset(ctx: Ctx) -> Case:
    """--data a:0.7,b:0.3 where b was never prepared (the mixture used to be read as one
    directory named "a:0.7,b:0.3", and the advice was to prepare that)."""
    c = copied(ctx)
    c.facts["missing"] = missing = ctx.tmp / "elsewhere" / "prose"
    return dataclasses.replace(c, data=Path(f"{c.data}:0.7,{missing}:0.3"))


def mixture_of_two_tokenizers(ctx: Ctx) -> Case:
    """A mixture of the byte-level dataset and one under another tokenizer."""
    c = copied(ctx)
    other = ctx.tmp / "gpt2"
    shutil.copytree(ctx.tiny_data, other)
    meta = json.loads((other / "meta.json").read_text())
    (other / "meta.json").write_text(json.dumps({**meta, "tokenizer": "gpt2"}))
    c.facts["other"] = other
    return dataclasses.replace(c, data=Path(f"{c.data}:0.5,{other}:0.5"))


def empty_dataset(ctx: Ctx) -> Case:
    (ctx.tmp / "empty").mkdir()
    return Case(ctx.tmp, ctx.tmp / "empty", ctx.tmp / "run")


def bad_magic(ctx: Ctx) -> Case:
    c = copied(ctx)
    with open(c.data / SHARD, "r+b") as f:
        f.write(b"NOTASHRD")
    return c


def truncated_shard(ctx: Ctx) -> Case:
    c = copied(ctx)
    tokens = train_tokens(c)  # one train shard
    size = HEADER_BYTES + 2 * tokens  # uint16: the byte vocabulary (257) fits
    assert (c.data / SHARD).stat().st_size == size
    os.truncate(c.data / SHARD, size - 100)
    c.facts.update(tokens=tokens, size=size)
    return c


def flipped_byte(ctx: Ctx) -> Case:
    """One payload bit flipped: header, size and token count still agree; only the hash does not."""
    c = copied(ctx)
    shard = c.data / SHARD
    listed = sha256(shard)
    raw = bytearray(shard.read_bytes())
    raw[HEADER_BYTES + 1000] ^= 0x01
    shard.write_bytes(bytes(raw))
    c.facts.update(file=sha256(shard)[:16], meta=listed[:16])
    return c


def corrupt_dataset_meta(ctx: Ctx) -> Case:
    c = copied(ctx)
    c.facts["error"] = truncate_half(c.data / "meta.json")
    return c


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

def row(id_: str, setup: Callable[[Ctx], Case], command: Callable[[Case], list],
        expected: Callable[[Case], str]):
    return pytest.param(setup, command, expected, id=id_)


E = "ddpgpt: error: "

CASES = [
    row("missing-dataset", missing_dataset, train,
        lambda c: f"{E}dataset {c.data} does not exist; create it with: "
                  f"ddpgpt prepare --out {c.data}"),
    row("mixture-missing-dataset", mixture_with_a_missing_dataset, train,
        lambda c: f"{E}dataset {c.facts['missing']} does not exist; create it with: "
                  f"ddpgpt prepare --out {c.facts['missing']}"),
    row("mixture-two-tokenizers", mixture_of_two_tokenizers, train,
        lambda c: f"{E}data.dir: {c.tmp / 'data'} and {c.facts['other']} have different "
                  f"tokenizers (byte, gpt2): a mixture's ids must mean the same text; prepare "
                  f"{c.facts['other']} again with --tokenizer-from {c.tmp / 'data'}"),
    row("empty-dataset", empty_dataset, train,
        lambda c: f"{E}dataset {c.data} has no meta.json (not prepared, or prepare did not "
                  f"finish); {REPREPARE} --out {c.data}"),
    row("shard-bad-magic", bad_magic, train,
        lambda c: f"{E}{c.data / SHARD}: not a ddpgpt shard (bad magic b'NOTASHRD'); {REPREPARE}"),
    row("shard-truncated", truncated_shard, train,
        lambda c: f"{E}{c.data / SHARD}: truncated: header says {c.facts['tokens']} uint16 tokens "
                  f"({c.facts['size']} bytes) but the file has {c.facts['size'] - 100} bytes; "
                  f"{REPREPARE}"),
    row("shard-checksum", flipped_byte, train,
        lambda c: f"{E}{c.data / SHARD}: sha256 mismatch (file {c.facts['file']}, "
                  f"meta.json {c.facts['meta']}): the shard changed after prepare; {REPREPARE}"),
    row("dataset-meta-corrupt", corrupt_dataset_meta, train,
        lambda c: f"{E}{c.data / 'meta.json'}: corrupt or incomplete meta.json "
                  f"({c.facts['error']}); {REPREPARE}"),
    row("vocab-above-model", copied, lambda c: train(c, model__vocab_size=64),
        lambda c: f"{E}dataset {c.data} has a vocabulary of 257 but model.vocab_size = 64; "
                  "set model.vocab_size >= 257 (or 0 to follow the dataset)"),
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
                  "known: name, lr, min_lr, warmup_steps, decay_steps, schedule, decay_fraction, "
                  "weight_decay, beta1, "
                  "beta2, eps, "
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
    row("dataset-below-global-batch", copied, lambda c: train(c, data__global_batch=4096),
        lambda c: f"{E}dataset {c.data}: the train split has {(train_tokens(c) - 1) // 32} "
                  "windows of 33 tokens, fewer than one global batch of 4096; use a larger "
                  "dataset, or a smaller data.seq_len / data.global_batch"),
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
    with ExitStack() as stack:
        c = setup(Ctx(tmp_path, tiny_data, request, stack))
        before = snapshot(c.data), snapshot(c.run)
        start = time.monotonic()
        r = run_cli(*command(c), env=c.env, timeout=60)
        elapsed = time.monotonic() - start
    output = (f"exit {r.returncode} after {elapsed:.1f} s\nstdout: {r.stdout!r}\n"
              f"stderr: {r.stderr!r}")
    assert "Traceback" not in r.stdout + r.stderr, output
    assert r.returncode == 2, output
    assert elapsed < 30, output
    assert r.stdout == "", output
    assert (len(r.stderr.splitlines()) == 1 and r.stderr.startswith(E)
            and r.stderr.endswith("\n")), output
    assert (snapshot(c.data), snapshot(c.run)) == before, \
        "the failing command changed the data or run dir"
    if before[1] is None:
        assert not c.run.exists()
    line = expected(c)
    assert r.stderr == line + "\n", f"\nactual:   {r.stderr.rstrip()}\nexpected: {line}"


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

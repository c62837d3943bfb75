"""The bad-input catalogue of the dataset, end to end: for each broken dataset (missing, empty,
a shard damaged, its meta.json cut short, a mixture that cannot be one, a vocabulary larger than
the model's, too few windows for one global batch) the real command line exits non-zero within
seconds with exactly one line on stderr, "ddpgpt: error: " + what is wrong, where (file or field)
and what to do; no traceback, nothing on stdout, and nothing written, overwritten or deleted in the
data dir or the run dir.

The rows and the check they go through: tests/e2e/bad_input_cases.py; the config, the run dir,
its checkpoints and the launch: tests/e2e/test_bad_input_run.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import pytest

from ddpgpt.data.shards import HEADER_BYTES
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

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

SHARD = "train_000000.bin"
REPREPARE = "re-run ddpgpt prepare"


def train_tokens(c: Case) -> int:
    """Tokens in the dataset's train split, as its meta.json lists them."""
    return sum(s["tokens"]
               for s in json.loads((c.data / "meta.json").read_text())["shards"]["train"])


# ---- setups: each builds one broken state in ctx.tmp ---------------------------------------

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

# ---- the catalogue ------------------------------------------------------------------------

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
    row("dataset-below-global-batch", copied, lambda c: train(c, data__global_batch=4096),
        lambda c: f"{E}dataset {c.data}: the train split has {(train_tokens(c) - 1) // 32} "
                  "windows of 33 tokens, fewer than one global batch of 4096; use a larger "
                  "dataset, or a smaller data.seq_len / data.global_batch"),
]


@pytest.mark.parametrize(("setup", "command", "expected"), CASES)
def test_bad_input(setup, command, expected, tiny_data, tmp_path, request):
    check(setup, command, expected, tiny_data, tmp_path, request)

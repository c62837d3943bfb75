"""Encoding units into token files, on this process or on N worker processes.

A unit's result is two files in the work directory, named by the unit's index: `NNNNNNNN.tok`
(the unit's token stream, end-of-text before each document, in the dataset's dtype) and
`NNNNNNNN.json` (each document's tokens and UTF-8 bytes, and what reading found), the json
renamed into place last (conversations, prepare --chat: also `NNNNNNNN.mask`, the loss mask of
each token, data/chat.py; the json says "mask"): a unit whose json exists is done, whoever did
it and whenever. Each unit is encoded alone from its own inputs, so the files do not depend on
how many workers there were or which one took it: the shards assembled from them are
byte-identical for any N.

Workers are spawned processes (the parent may hold threads: the bpe trainer's, tqdm's), each with
its own single-threaded tokenizer: tokenizing, JSON and parquet decoding all hold the GIL or their
own pool, and processes scale where threads would not. A worker ignores SIGINT (the terminal
sends it to the whole group; the parent decides) and dies with its parent: it is asked to by the
kernel (PR_SET_PDEATHSIG on Linux), and its pipe to the parent reaches EOF in any case.
Each worker is handed the parent's table of formats (formats/table.py), so that a format the
parent registered is read there too.
"""

from __future__ import annotations

import ctypes
import itertools
import json
import multiprocessing
import os
import signal
import sys
import traceback
from collections.abc import Iterator
from dataclasses import asdict
from multiprocessing.connection import wait
from pathlib import Path

import numpy as np

from ddpgpt.data import chat
from ddpgpt.data.formats import table
from ddpgpt.data.formats.base import Unit, UnitStats, clean
from ddpgpt.data.prepare.space import FULL
from ddpgpt.errors import UserError
from ddpgpt.files import atomic_write

BATCH_BYTES = 4 << 20  # text per encode_batch call
BATCH_CONVERSATIONS = 1024  # conversations per encode_batch call


def unit_paths(work: Path, index: int) -> tuple[Path, Path]:
    return work / f"{index:08d}.tok", work / f"{index:08d}.json"


def is_done(work: Path, index: int) -> bool:
    return unit_paths(work, index)[1].is_file()


def mask_path(work: Path, index: int) -> Path:
    return work / f"{index:08d}.mask"


def _mapped(path: Path, dtype) -> np.ndarray:
    n = path.stat().st_size // np.dtype(dtype).itemsize
    return np.memmap(path, dtype=dtype, mode="r") if n else np.zeros(0, dtype=dtype)


def read_unit(work: Path, index: int) -> tuple[np.ndarray, dict, np.ndarray | None]:
    """A finished unit: its tokens (a memory map), its record and its loss mask (None but for
    conversations)."""
    tok, rec = unit_paths(work, index)
    record = json.loads(rec.read_text())
    mask = _mapped(mask_path(work, index), np.uint8) if record.get("mask") else None
    return _mapped(tok, np.dtype(record["dtype"])), record, mask


def encode_unit(unit: Unit, tok, dtype: str, work: Path, index: int, text_field: str,
                skip_bad: bool, reading: chat.Reading | None = None) -> None:
    """Reads, encodes and writes one unit (see the module docstring); memory: a batch.
    `reading`: the records are conversations, read so (prepare --chat)."""
    tok_path, rec_path = unit_paths(work, index)
    stats, docs = UnitStats(), []
    raw = tok.kind == "byte"
    try:
        if reading is None:
            _encode_into(tok_path, unit, tok, dtype, text_field, skip_bad, stats, docs, raw)
        else:
            _encode_chat(tok_path, mask_path(work, index), unit, tok, dtype, text_field,
                         skip_bad, reading, stats, docs)
    except OSError as e:
        if e.errno in FULL and not e.filename:  # a write's error names no file: this one
            e.filename = str(tok_path)
        raise
    record = {"dtype": dtype, "docs": docs, "stats": asdict(stats),
              **({"mask": True} if reading is not None else {}),
              **({"split": unit.split} if unit.split else {})}  # a unit of one split
    with atomic_write(rec_path) as f:
        f.write(json.dumps(record, separators=(",", ":")).encode())


def _encode_into(tok_path: Path, unit: Unit, tok, dtype: str, text_field: str, skip_bad: bool,
                 stats: UnitStats, docs: list, raw: bool) -> None:
    eot = np.array([tok.eot_id], dtype=dtype)
    with open(tok_path, "wb") as f:
        for batch in _batches(table.pieces(unit, stats, text_field, skip_bad, raw)):
            encoded = tok.encode_batch([piece for _, piece in batch])
            arrays = []
            for (first, piece), ids in zip(batch, encoded, strict=True):
                if first:
                    docs.append([1, 0])
                    arrays.append(eot)
                size = len(piece) if raw else len(piece.encode("utf-8", "surrogatepass"))
                docs[-1][0] += len(ids)
                docs[-1][1] += size
                stats.text_bytes += size
                arrays.append(ids.astype(dtype, copy=False))
            f.write(np.concatenate(arrays).tobytes())


def _encode_chat(tok_path: Path, mask_file: Path, unit: Unit, tok, dtype: str, field: str,
                 skip_bad: bool, reading: chat.Reading, stats: UnitStats, docs: list) -> None:
    """The unit's conversations rendered by the chat template, tokens and mask apart."""
    records = table.records(unit, stats, field, skip_bad)
    convs = chat.conversations(records, stats, reading, UserError)
    with open(tok_path, "wb") as f, open(mask_file, "wb") as g:
        batch: list = []
        for conv in itertools.chain(convs, [None]):  # None: the end, the last batch goes
            if conv is not None:
                for m in conv:
                    m["content"] = clean(m["content"], stats)
                batch.append(conv)
            if batch and (conv is None or len(batch) == BATCH_CONVERSATIONS):
                for conv_, (tokens, mask) in zip(batch, chat.render(
                        batch, tok.encode_batch, tok.special, tok.eot_id)):
                    size = sum(len(m["content"].encode("utf-8")) for m in conv_)
                    stats.documents += 1
                    stats.text_bytes += size
                    docs.append([len(tokens), size])
                    f.write(tokens.astype(dtype).tobytes())
                    g.write(mask.tobytes())
                batch = []


def _batches(pieces: Iterator[tuple[bool, str | bytes]]) -> Iterator[list]:
    batch, size = [], 0
    for piece in pieces:
        batch.append(piece)
        size += len(piece[1])
        if size >= BATCH_BYTES:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


class Encoder:
    """Encodes units by index, `workers` at a time; `results` yields each index once done, in
    the order they finish. One worker encodes on this process (no spawn, no pipes)."""

    def __init__(self, workers: int, make_tok, dtype: str, work: Path, text_field: str,
                 skip_bad: bool, reading: chat.Reading | None = None, local=None):
        """`local`: the tokenizer this process already has, for one worker; `reading`:
        conversations (encode_unit)."""
        self.args = (dtype, str(work), text_field, skip_bad, reading)
        self.make_tok, self.work = make_tok, work
        self.procs: list = []
        self.conns: list = []
        self._tok = (local or make_tok()) if workers == 1 else None
        if workers > 1:
            ctx = multiprocessing.get_context("spawn")
            for _ in range(workers):
                parent, child = ctx.Pipe()
                proc = ctx.Process(target=_serve, daemon=True,
                                   args=(child, make_tok, self.args, dict(table.FORMATS)))
                proc.start()
                child.close()  # the parent's copy: the worker's recv sees EOF when we are gone
                self.procs.append(proc)
                self.conns.append(parent)

    def run(self, todo: Iterator[tuple[int, Unit]], ahead) -> Iterator[int | None]:
        """Encodes each (index, unit) of `todo`, yielding each index when done; `ahead(index)`
        says whether index may start now (the caller bounds how far encoding runs ahead of its
        use; None is yielded when it holds the next one back and nothing else runs)."""
        if self._tok is not None:
            for index, unit in todo:
                encode_unit(unit, self._tok, self.args[0], self.work, index, *self.args[2:])
                yield index
            return
        idle, busy, pending = list(self.conns), {}, None
        todo = iter(todo)
        while True:
            while idle:
                if pending is None:
                    pending = next(todo, None)
                    if pending is None:
                        break
                if not ahead(pending[0]):
                    break
                conn = idle.pop()
                conn.send(pending)
                busy[conn] = pending[0]
                pending = None
            if not busy:
                if pending is None:
                    return
                yield None  # blocked by `ahead`: the caller uses what is done, then we go on
                continue
            for conn in wait(list(busy)):
                index = busy.pop(conn)
                _check_reply(conn, index, self.procs[self.conns.index(conn)])
                idle.append(conn)
                yield index

    def close(self) -> None:
        for conn in self.conns:
            try:
                conn.send(None)
            except OSError:
                pass
            conn.close()
        for proc in self.procs:
            proc.join(timeout=2)
            if proc.is_alive():
                proc.kill()
                proc.join()
        self.procs, self.conns = [], []


def _check_reply(conn, index: int, proc) -> None:
    try:
        kind, message = conn.recv()
    except (EOFError, OSError):
        proc.join(timeout=5)
        raise UserError(f"a prepare worker (pid {proc.pid}) died while encoding unit {index} "
                        f"(exit code {proc.exitcode}); out of memory? Run the same command "
                        "again to continue, with fewer --workers") from None
    if kind == "error":
        raise UserError(message)
    if kind == "full":
        code, path = message
        raise OSError(code, os.strerror(code), path)
    if kind == "crash":
        raise RuntimeError(f"a prepare worker failed on unit {index}:\n{message}")


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass


def _serve(conn, make_tok, args, formats: dict) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _die_with_parent()
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker
    dtype, work, text_field, skip_bad, reading = args
    table.FORMATS.clear()  # the parent's table: a format registered there is known here
    table.FORMATS.update(formats)
    tok = make_tok()
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):
            return
        if job is None:
            return
        index, unit = job
        try:
            encode_unit(unit, tok, dtype, Path(work), index, text_field, skip_bad, reading)
            reply = ("ok", "")
        except UserError as e:
            reply = ("error", str(e))
        except OSError as e:
            if e.errno not in FULL:
                reply = ("crash", traceback.format_exc())
            else:  # the parent says it, with the space the dataset needs (space.py)
                reply = ("full", (e.errno, e.filename or str(unit_paths(Path(work), index)[0])))
        except Exception:
            reply = ("crash", traceback.format_exc())
        try:
            conn.send(reply)
        except OSError:
            return

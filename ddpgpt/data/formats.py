"""The corpus as a list of units of work, and each unit's documents.

`plan` turns the resolved source files into `Unit`s in the corpus's fixed order (sources in the
order given, files sorted, rows in file order): a group of text files, a block of a plain
`.jsonl`, a whole compressed `.jsonl.gz` / `.jsonl.zst` / `.json.gz`, one parquet row group, an
`hf:` dataset, or an llm.c shard. A unit is what one worker encodes at a time and what a resumed
prepare skips once done: small enough that a kill loses little, large enough that its overhead is
nothing. `pieces(unit)` reads a unit's documents, in pieces of at most `sources.PIECE_CHARS`.

Parquet is read with pyarrow one record batch at a time (never a whole file, never a whole row
group's Python strings); `.zst` with zstandard, every frame, a file cut short an error naming it
(compressed.py). llm.c / modded-nanogpt shards are recognised by their header (256 int32: magic
20240520, version 1, token count; then uint16 GPT-2 tokens) and taken as tokens.
"""

from __future__ import annotations

import gzip
import json
import re
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from ddpgpt.data import columns, llmc, sources
from ddpgpt.data.compressed import open_zstd
from ddpgpt.errors import UserError
from ddpgpt.files import require

UNIT_BYTES = 8 << 20  # text per unit of plain files and jsonl blocks
UNIT_FILES = 4096  # small text files per unit at most
LLMC_MAGIC, LLMC_VERSION, LLMC_HEADER_BYTES = 20240520, 1, 256 * 4
LLMC_VOCAB, LLMC_EOT = 50257, 50256
PARQUET_BATCH_ROWS = 1024
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".json.gz")
_SURROGATE = re.compile("[\ud800-\udfff]")
SKIP_HINT = "or pass --skip-bad-rows to count and skip such rows"


@dataclass(frozen=True)
class Unit:
    """One piece of work. kind: text (paths: files, one document each), jsonl (the lines that
    start in bytes [start, end) of paths[0]; end -1: the whole, compressed, file), parquet
    (row group `start` of paths[0]), hf (paths: name, config, split), llmc (paths[0], whose
    tokens all go to `split`)."""

    kind: str
    paths: tuple = ()
    start: int = 0
    end: int = -1
    split: str = ""


@dataclass
class UnitStats:
    """What reading a unit found, summed over units into the summary and meta.json."""

    documents: int = 0
    skipped_binary: int = 0
    skipped_empty: int = 0
    bad_rows: int = 0
    null_rows: int = 0  # rows whose text is null (parquet, hf)
    replaced: int = 0  # invalid UTF-8 sequences (or lone surrogates) replaced by U+FFFD
    text_bytes: int = 0

    def add(self, other: dict) -> None:
        for key, value in other.items():
            setattr(self, key, getattr(self, key) + value)


@dataclass
class Plan:
    units: list[Unit] = field(default_factory=list)
    files: list[dict] = field(default_factory=list)  # the document order, for meta.json
    text_bytes: int | None = 0  # size of the inputs (None: a streamed source)
    stamps: list = field(default_factory=list)  # each file's size and time: changed inputs

    @property
    def llmc(self) -> bool:
        return bool(self.units) and self.units[0].kind == "llmc"


def file_kind(path: Path) -> str:
    name = path.name.lower()
    if name.endswith(".parquet"):
        return "parquet"
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if name.endswith(".bin") and _read_head(path, 4) == np.int32(LLMC_MAGIC).tobytes():
        return "llmc"
    return "text"


def _read_head(path: Path, n: int) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read(n)
    except OSError as e:
        raise UserError(f"{path}: cannot read it ({e.strerror}); check its permissions") from None


def plan(corpus: sources.Corpus, text_field: str) -> Plan:
    """The units of `corpus`, in its fixed order; refuses what cannot be read before any work."""
    out, group, group_bytes = Plan(), [], 0

    def close_group():
        nonlocal group, group_bytes
        if group:
            out.units.append(Unit("text", tuple(group)))
        group, group_bytes = [], 0

    for part in corpus.parts:
        close_group()  # a unit never spans two sources
        if isinstance(part, tuple):
            out.units.append(Unit("hf", tuple(part)))
            out.files.append({"hf": ":".join(p or "" for p in part)})
            out.text_bytes = None
            continue
        for path in part:
            kind, size = file_kind(path), path.stat().st_size
            record = {"path": str(path), "bytes": size}
            regular = path.is_file()  # a pipe's size and time say nothing of its contents
            out.stamps.append([size, path.stat().st_mtime_ns] if regular else None)
            if out.text_bytes is not None:
                out.text_bytes += size
            if kind == "text":
                group.append(str(path))
                group_bytes += size
                if group_bytes >= UNIT_BYTES or len(group) >= UNIT_FILES:
                    close_group()
                out.files.append(record)
                continue
            close_group()
            if kind == "parquet":
                record["row_groups"] = _parquet_row_groups(path, text_field)
                out.units += [Unit("parquet", (str(path),), i)
                              for i in range(record["row_groups"])]
            elif kind == "jsonl":
                out.units += _jsonl_units(path, size)
            else:
                split = llmc.split_of(path.name)  # the word val, not the letters
                record["tokens"] = llmc_tokens(path, size)
                record["split"] = split
                out.units.append(Unit("llmc", (str(path),), split=split))
            out.files.append(record)
    close_group()
    _check_llmc(out)
    return out


def _jsonl_units(path: Path, size: int) -> list[Unit]:
    if not path.name.lower().endswith(".jsonl"):  # compressed: read from the start, whole
        return [Unit("jsonl", (str(path),))]
    return [Unit("jsonl", (str(path),), start, min(start + UNIT_BYTES, size))
            for start in range(0, size, UNIT_BYTES)]


def _check_llmc(out: Plan) -> None:
    """llm.c shards are tokens already: they cannot share a dataset with text to encode."""
    kinds = {u.kind for u in out.units}
    if "llmc" not in kinds or kinds == {"llmc"}:
        return
    shard = next(u.paths[0] for u in out.units if u.kind == "llmc")
    other = next(u for u in out.units if u.kind != "llmc")
    name = other.paths[0] if other.kind != "hf" else f"hf:{other.paths[0]}"
    if str(name).endswith(".bin"):
        head = _read_head(Path(name), 4)
        magic = int.from_bytes(head, "little") if len(head) == 4 else None
        raise UserError(f"{name}: not an llm.c shard (magic {magic}, expected {LLMC_MAGIC}) "
                        f"among the llm.c shards of the sources ({shard}); remove it from them")
    raise UserError(f"the sources mix llm.c shards ({shard}) with text ({name}); the shards are "
                    "tokens already: prepare them apart from the text")


def llmc_tokens(path: Path, size: int) -> int:
    """An llm.c shard's token count, after checking its header against its size."""
    head = np.frombuffer(_read_head(path, LLMC_HEADER_BYTES).ljust(12, b"\0"), dtype="<i4")
    if size < LLMC_HEADER_BYTES:
        raise UserError(f"{path}: truncated llm.c shard ({size} bytes, shorter than its "
                        f"{LLMC_HEADER_BYTES}-byte header); download it again")
    if head[1] != LLMC_VERSION:
        raise UserError(f"{path}: llm.c shard version {head[1]}, expected {LLMC_VERSION} "
                        "(uint16 GPT-2 tokens); convert it or remove it from the sources")
    count, expected = int(head[2]), LLMC_HEADER_BYTES + 2 * int(head[2])
    if size != expected:
        what = "truncated" if size < expected else "has trailing bytes"
        raise UserError(f"{path}: llm.c shard {what}: its header says {count} tokens "
                        f"({expected} bytes) but the file has {size} bytes; download it again")
    return count


def llmc_array(path: str) -> np.ndarray:
    """An llm.c shard's tokens as a read-only memory map."""
    count = int(np.fromfile(path, dtype="<i4", count=3)[2])
    if count == 0:
        return np.zeros(0, dtype=np.uint16)
    return np.memmap(path, dtype="<u2", mode="r", offset=LLMC_HEADER_BYTES, shape=(count,))


def _parquet_row_groups(path: Path, text_field: str) -> int:
    pq = _pyarrow()
    try:
        meta = pq.ParquetFile(path)
    except Exception as e:
        raise UserError(f"{path}: not a readable parquet file ({_first_line(e)}); download it "
                        "again or remove it from the sources") from None
    names = meta.schema_arrow.names
    if text_field not in names:
        raise UserError(f"{path}: no column {text_field!r} (columns: {', '.join(names)}); "
                        "name the text column with --text-field")
    columns.check_parquet_column(path, text_field, meta.schema_arrow.field(text_field).type)
    return meta.num_row_groups


def _pyarrow():
    return require("pyarrow.parquet", "data", "a parquet source")


def _first_line(e: BaseException) -> str:
    text = str(e).splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}: {text[:200]}" if text else type(e).__name__


# --- reading a unit ------------------------------------------------------------------------


def pieces(unit: Unit, stats: UnitStats, text_field: str, skip_bad: bool,
           raw: bool) -> Iterator[tuple[bool, str | bytes]]:
    """The unit's documents as (begins a document, piece) pairs. `raw`: pieces of text files as
    their bytes, exactly (the byte tokenizer); else as text, invalid UTF-8 replaced (counted)."""
    if unit.kind == "text":
        for path in unit.paths:
            yield from _text_file(Path(path), stats, raw)
        return
    if unit.kind == "jsonl":
        texts = _jsonl_texts(unit, text_field, skip_bad, stats)
    elif unit.kind == "parquet":
        texts = _parquet_texts(unit, text_field)
    elif unit.kind == "hf":
        texts = sources.hf_texts(*unit.paths, text_field=text_field)
    else:
        raise ValueError(f"unit kind {unit.kind} has no text")
    for text in texts:
        if not isinstance(text, str):
            columns.check_value(f"hf:{unit.paths[0]}", text_field, text)
            stats.null_rows += 1  # a null in a text column: no document, counted
            continue
        if not text:
            stats.skipped_empty += 1
            continue
        stats.documents += 1
        text = _clean(text, stats)
        piece_list = sources.cut([text], sources.PIECE_CHARS) if len(text) > sources.PIECE_CHARS \
            else [text]
        for i, piece in enumerate(piece_list):
            yield i == 0, piece.encode("utf-8") if raw else piece


def _clean(text: str, stats: UnitStats) -> str:
    """A str from JSON may hold lone surrogates (`"\\ud800"`), which are no UTF-8: each becomes
    U+FFFD, counted."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        text, n = _SURROGATE.subn("\ufffd", text)
        stats.replaced += n
        return text


def _text_file(path: Path, stats: UnitStats, raw: bool) -> Iterator[tuple[bool, str | bytes]]:
    chunks = sources.read_bytes_or_text(path, raw, stats)
    if chunks is None:
        stats.skipped_binary += 1
        return
    cut = sources.cut_bytes if raw else sources.cut
    first = True
    for piece in cut(chunks, sources.PIECE_CHARS):
        yield first, piece
        first = False
    if first:
        stats.skipped_empty += 1
    else:
        stats.documents += 1


def _parquet_texts(unit: Unit, text_field: str) -> Iterator[str | None]:
    pq = _pyarrow()
    path = unit.paths[0]
    try:
        f = pq.ParquetFile(path)
        batches = f.iter_batches(batch_size=PARQUET_BATCH_ROWS, row_groups=[unit.start],
                                 columns=[text_field])
        for batch in batches:
            yield from batch.column(0).to_pylist()
    except UserError:
        raise
    except Exception as e:
        raise UserError(f"{path}: row group {unit.start} cannot be read ({_first_line(e)}); "
                        "download the file again or remove it from the sources") from None


def _jsonl_texts(unit: Unit, text_field: str, skip_bad: bool,
                 stats: UnitStats) -> Iterator[str]:
    path = unit.paths[0]
    for number, line in _jsonl_lines(unit):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as e:
            if skip_bad:
                stats.bad_rows += 1
                continue
            where = f"{path}:{_line_number(unit, number)}"
            raise UserError(f"{where}: not a JSON object ({_first_line(e)}); fix the line, "
                            f"{SKIP_HINT}") from None
        text = row.get(text_field) if isinstance(row, dict) else None
        if isinstance(text, str):
            yield text
            continue
        if skip_bad:
            stats.bad_rows += 1
            continue
        where = f"{path}:{_line_number(unit, number)}"
        if not isinstance(row, dict):
            raise UserError(f"{where}: a JSON {type(row).__name__}, not an object; one object "
                            f"per line is expected; fix the line, {SKIP_HINT}")
        if text_field not in row:
            raise UserError(f"{where}: no field {text_field!r} (fields: {', '.join(row)}); name "
                            f"the text field with --text-field, {SKIP_HINT}")
        raise UserError(f"{where}: field {text_field!r} is {type(text).__name__}, not a string; "
                        f"fix the line, {SKIP_HINT}")


def _jsonl_lines(unit: Unit) -> Iterator[tuple[int, bytes]]:
    """(line number within the unit, line) for the lines that start in the unit's byte range."""
    path = unit.paths[0]
    try:
        with _open_jsonl(path) as f:
            if unit.end < 0:
                yield from enumerate(f, 1)
                return
            if unit.start > 0:
                f.seek(unit.start - 1)
                f.readline()  # the rest of the line that started before the block
            number = 0
            while f.tell() < unit.end:
                line = f.readline()
                if not line:
                    return
                number += 1
                yield number, line
    except (OSError, EOFError) as e:
        raise UserError(f"{path}: cannot be read ({_first_line(e)}); download it again or remove "
                        "it from the sources") from None


def _line_number(unit: Unit, number: int) -> int:
    """The line's number in its file: lines before the unit's block are counted only here. The
    block's first line starts after the first newline at or after byte start - 1."""
    if unit.start <= 0:
        return number
    with open(unit.paths[0], "rb") as f:
        return _count_newlines(f, unit.start - 1) + 1 + number


def _count_newlines(f, limit: int) -> int:
    f.seek(0)
    count, left = 0, limit
    while left > 0:
        block = f.read(min(left, 1 << 20))
        if not block:
            break
        count += block.count(b"\n")
        left -= len(block)
    return count


def _open_jsonl(path: str):
    name = path.lower()
    if name.endswith(".gz"):
        return gzip.open(path, "rb")
    if name.endswith(".zst"):
        return open_zstd(path)  # every frame; a file cut short is an EOFError, as gzip's
    return open(path, "rb")


def plan_record(p: Plan) -> dict:
    """What identifies the plan's inputs, for resuming and for merging parts."""
    return {"files": p.files, "units": [asdict(u) for u in p.units]}

"""The table of prepare's input formats, and the corpus as a list of units of work.

`plan` turns the resolved sources into `Unit`s in the corpus's fixed order (sources in the order
given, files sorted, rows in file order): each file goes to the first format that claims it
(text if none does), a streamed source to the format of its prefix. A unit is what one worker
encodes at a time and what a resumed prepare skips once done: small enough that a kill loses
little, large enough that its overhead is nothing. `pieces(unit)` reads a unit's documents, in
pieces of at most `base.PIECE_CHARS`, by its format; `records(unit)` its records' values, for a
format whose records may be conversations (prepare --chat).

A new format is one module (a `base.Format`) and one row here; `plan`, `pieces`, the worker
processes, the settings a format refuses (prepare/settings.py) and a tokens format's place in
the build read the row, never the format's name.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ddpgpt.data.formats import base, hf, jsonl, llmc, parquet, stdlib_chat, text
from ddpgpt.data.formats.base import Format, Unit, UnitStats
from ddpgpt.errors import UserError

FORMATS: dict[str, Format] = {row.name: row for row in (
    text.ROW,      # any file no other format claims; small files share a unit
    jsonl.ROW,     # .jsonl (in blocks), .jsonl.gz, .jsonl.zst, .json.gz (whole)
    parquet.ROW,   # .parquet, a unit per row group
    llmc.ROW,      # llm.c's .bin shards (by their header): tokens already
    hf.ROW,        # hf:NAME[:CONFIG][:SPLIT], streamed
    stdlib_chat.ROW,  # stdlib-chat: the built-in conversations (prepare --chat)
)}
FALLBACK = "text"  # a file no format claims


@dataclass
class Plan:
    units: list[Unit] = field(default_factory=list)
    files: list[dict] = field(default_factory=list)  # the document order, for meta.json
    text_bytes: int | None = 0  # size of the inputs (None: a streamed source)
    stamps: list = field(default_factory=list)  # each file's size and time: changed inputs

    @property
    def formats(self) -> list[Format]:
        """The formats of the units, each once, in order of first use."""
        return [FORMATS[kind] for kind in dict.fromkeys(u.kind for u in self.units)]

    @property
    def tokens(self) -> Format | None:
        """The format whose tokens all the units are (llm.c shards), or None: text to encode."""
        row = FORMATS[self.units[0].kind] if self.units else None
        return row if row is not None and row.tokens else None


def file_format(path: Path) -> Format:
    """The first format that claims `path`, else text."""
    return next((row for name, row in FORMATS.items() if name != FALLBACK and row.claims(path)),
                FORMATS[FALLBACK])


def streamed(spec: str) -> Format | None:
    """The format of a streamed source's spec (hf:NAME), or None: a path."""
    return next((row for row in FORMATS.values() if row.prefix and spec.startswith(row.prefix)),
                None)


@dataclass(frozen=True)
class Stream:
    """A streamed source of a corpus: its format's name and its unit's paths."""

    kind: str
    paths: tuple


def plan(corpus, text_field: str, chat: bool = False) -> Plan:
    """The units of `corpus` (prepare/sources.py: its parts, each a list of paths or a
    `Stream`), in its fixed order; refuses what cannot be read before any work. `chat`: each
    record a conversation (prepare --chat): a source of a format without records is refused."""
    out, group, group_bytes = Plan(), [], 0

    def close_group():
        nonlocal group, group_bytes
        if group:
            out.units.append(Unit(group[0][0], tuple(p for _, p in group)))
        group, group_bytes = [], 0

    for part in corpus.parts:
        close_group()  # a unit never spans two sources
        if isinstance(part, Stream):
            _check_chat(chat, FORMATS[part.kind], f"{part.kind}:{part.paths[0]}")
            out.units += FORMATS[part.kind].plan_stream(part.paths)
            out.files.append(FORMATS[part.kind].stream_record(part.paths))
            out.text_bytes = None
            continue
        for path in part:
            row, size = file_format(path), path.stat().st_size
            _check_chat(chat, row, path)
            record = {"path": str(path), "bytes": size}
            regular = path.is_file()  # a pipe's size and time say nothing of its contents
            out.stamps.append([size, path.stat().st_mtime_ns] if regular else None)
            if out.text_bytes is not None:
                out.text_bytes += size
            if row.groups:
                if group and group[0][0] != row.name:
                    close_group()
                group.append((row.name, str(path)))
                group_bytes += size
                if group_bytes >= base.UNIT_BYTES or len(group) >= base.UNIT_FILES:
                    close_group()
                out.files.append(record)
                continue
            close_group()
            out.units += row.plan_file(path, size, record, text_field,
                                       **({"chat": True} if chat else {}))
            out.files.append(record)
    close_group()
    _check_tokens(out)
    return out


def _check_chat(chat: bool, row: Format, where) -> None:
    if not chat and row.only_conversations:
        raise UserError(f"{row.described} are conversations: prepare them with --chat")
    if chat and not row.conversations:
        holding = ", ".join(r.name for r in FORMATS.values() if r.conversations)
        raise UserError(f"prepare --chat: {where} is a {row.name} source, whose records cannot "
                        f"be conversations; give records with a list of messages ({holding})")


def _check_tokens(out: Plan) -> None:
    """Units that are tokens already cannot share a dataset with others (text to encode, or
    another format's tokens): their format says so in one line."""
    kinds = {u.kind for u in out.units}
    for kind in kinds:
        row = FORMATS[kind]
        if row.tokens and kinds != {kind}:
            shard = next(u.paths[0] for u in out.units if u.kind == kind)
            other = next(u for u in out.units if u.kind != kind)
            row.refuse_mix(shard, FORMATS[other.kind].where(other))


def pieces(unit: Unit, stats: UnitStats, text_field: str, skip_bad: bool,
           raw: bool) -> Iterator[tuple[bool, str | bytes]]:
    """The unit's documents as (begins a document, piece) pairs. `raw`: pieces of text files as
    their bytes, exactly (the byte tokenizer); else as text, invalid UTF-8 replaced (counted)."""
    row = FORMATS[unit.kind]
    if row.tokens:
        raise ValueError(f"unit kind {unit.kind} has no text")
    return row.pieces(unit, stats, text_field, skip_bad, raw)


def records(unit: Unit, stats: UnitStats, name: str,
            skip_bad: bool) -> Iterator[tuple[str, object]]:
    """The unit's records as (where, value of field `name`): prepare --chat's conversations."""
    return FORMATS[unit.kind].records(unit, name, skip_bad, stats)


def plan_record(p: Plan) -> dict:
    """What identifies the plan's inputs, for resuming and for merging parts."""
    return {"files": p.files, "units": [asdict(u) for u in p.units]}

"""JSON lines: each line an object whose text field (`--text-field`, default "text") is one
document. A plain `.jsonl` is cut into units of the lines that start in each `base.UNIT_BYTES`
block; a compressed one (`.jsonl.gz`, `.jsonl.zst`, `.json.gz`) is one unit, read from its start
(`.zst`: every frame, a file cut short an error naming it, compressed.py). A line that is not an
object with a string there is one line naming FILE:LINE, or, with `--skip-bad-rows`, counted and
skipped.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from ddpgpt.data.compressed import open_any
from ddpgpt.data.formats import base
from ddpgpt.data.formats.base import Format, Unit, UnitStats, first_line
from ddpgpt.errors import UserError

SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".json.gz")
SKIP_HINT = "or pass --skip-bad-rows to count and skip such rows"


class Jsonl(Format):
    name = "jsonl"
    conversations = True

    def claims(self, path: Path) -> bool:
        return path.name.lower().endswith(SUFFIXES)

    def plan_file(self, path: Path, size: int, record: dict, text_field: str,
                  chat: bool = False) -> list[Unit]:
        if not path.name.lower().endswith(".jsonl"):  # compressed: read from the start, whole
            return [Unit(self.name, (str(path),))]
        return [Unit(self.name, (str(path),), start, min(start + base.UNIT_BYTES, size))
                for start in range(0, size, base.UNIT_BYTES)]

    def texts(self, unit: Unit, text_field: str, skip_bad: bool,
              stats: UnitStats) -> Iterator[str]:
        for number, row in _rows(unit, text_field, skip_bad, stats):
            text = row[text_field]
            if isinstance(text, str):
                yield text
                continue
            if skip_bad:
                stats.bad_rows += 1
                continue
            where = f"{unit.paths[0]}:{_line_number(unit, number)}"
            if looks_like_messages(text):
                raise UserError(f"{where}: field {text_field!r} holds a conversation (a list "
                                "of messages), not text; prepare conversations with --chat")
            raise UserError(f"{where}: field {text_field!r} is {type(text).__name__}, not a "
                            f"string; fix the line, {SKIP_HINT}")

    def records(self, unit: Unit, field: str, skip_bad: bool,
                stats: UnitStats) -> Iterator[tuple[str, object]]:
        for number, row in _rows(unit, field, skip_bad, stats):
            yield f"{unit.paths[0]}:{_line_number(unit, number)}", row[field]


def _rows(unit: Unit, field: str, skip_bad: bool,
          stats: UnitStats) -> Iterator[tuple[int, dict]]:
    """(line number in the unit, object) of each line that is an object holding `field`; other
    lines are one line naming FILE:LINE, or, `skip_bad`, counted and skipped."""
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
            raise UserError(f"{where}: not a JSON object ({first_line(e)}); fix the line, "
                            f"{SKIP_HINT}") from None
        if isinstance(row, dict) and field in row:
            yield number, row
            continue
        if skip_bad:
            stats.bad_rows += 1
            continue
        where = f"{path}:{_line_number(unit, number)}"
        if not isinstance(row, dict):
            raise UserError(f"{where}: a JSON {type(row).__name__}, not an object; one object "
                            f"per line is expected; fix the line, {SKIP_HINT}")
        if looks_like_messages(row.get("messages")):
            raise UserError(f"{where}: no field {field!r}, and its 'messages' is a "
                            "conversation; prepare conversations with --chat")
        raise UserError(f"{where}: no field {field!r} (fields: {', '.join(row)}); "
                        f"name the text field with --text-field, {SKIP_HINT}")


def looks_like_messages(value) -> bool:
    """A list of {role, content} objects: a conversation given where text was asked for."""
    return isinstance(value, list) and bool(value) and \
        all(isinstance(m, dict) and "role" in m and "content" in m for m in value)


def _jsonl_lines(unit: Unit) -> Iterator[tuple[int, bytes]]:
    """(line number within the unit, line) for the lines that start in the unit's byte range."""
    path = unit.paths[0]
    try:
        with open_any(path) as f:
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
        raise UserError(f"{path}: cannot be read ({first_line(e)}); download it again or remove "
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





ROW = Jsonl()

"""What every input format of `prepare` is: a `Format` (a row of `table.FORMATS`), the `Unit`s of
work it cuts its inputs into, what reading a unit found (`UnitStats`), and the cutting of a long
document into pieces of at most `PIECE_CHARS`.

A format answers four questions, and declares the settings that do not apply to it:

    claims(path)            a file of this format? (a file no format claims is text)
    plan_file(path, size, record, text_field)
                            the file's units, in order, refusing what cannot be read before any
                            work; `record` (meta.json's entry for the file) takes what it learns
    texts(unit, text_field, skip_bad, stats)
                            a unit's documents, each a str (None: a null row, counted); or
    pieces(...)             the same as (begins a document, piece) pairs, when a format reads
                            its own (text files: bytes, exactly, for the byte tokenizer)
    records(unit, field, skip_bad, stats)
                            a format of records (`conversations`: jsonl, parquet): each
                            record's (where, value of `field`), whatever its type, for
                            `prepare --chat` (data/chat.py reads the value as messages)
    refuses                 prepare's settings (PrepareConfig's field names) that do not apply
                            to sources all of this format: given, they are refused in one line

A streamed source (`prefix`, e.g. "hf:") is named by a spec instead of a path: `stream(spec)` is
its unit's `paths`. A format whose units are tokens already (`tokens`: llm.c shards) gives them
by `array(unit)`, records each file's count as `record["tokens"]`, and names the tokenizer
they are of. A format's rows must pickle (a module-level
class): prepare's worker processes receive the table.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from ddpgpt.data import columns
from ddpgpt.errors import UserError

PIECE_CHARS = 1 << 20  # a longer document is read and encoded in pieces of at most this
UNIT_BYTES = 8 << 20  # text per unit of plain files and jsonl blocks
UNIT_FILES = 4096  # small text files per unit at most
_SURROGATE = re.compile("[\ud800-\udfff]")
# On reversed text: a non-space then a newline (or any ASCII whitespace) is, read forwards, a
# whitespace character that starts a word: a cut before it keeps every pre-token (see _cut_point).
_WORD_AFTER_NEWLINE = re.compile(r"\S\n")
_WORD_AFTER_SPACE = re.compile(r"\S[\t\n\v\f\r ]")


@dataclass(frozen=True)
class Unit:
    """One piece of work. kind: the format's name in FORMATS; paths, start, end and split are
    the format's: text (paths: files, one document each), jsonl (the lines that start in bytes
    [start, end) of paths[0]; end -1: the whole, compressed, file), parquet (row group `start` of
    paths[0]), hf (paths: name, config, split), llmc (paths[0], whose tokens all go to
    `split`), stdlib-chat (paths[0]: the standard library; its conversations of `split`)."""

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
    # records that are not conversations (prepare --chat: data/chat.py's REASONS)
    chat_malformed: int = 0
    chat_unknown_role: int = 0
    chat_empty: int = 0
    chat_no_assistant: int = 0

    def add(self, other: dict) -> None:
        for key, value in other.items():
            setattr(self, key, getattr(self, key) + value)


class Format:
    """A row of FORMATS (see the module docstring); the defaults are a text-yielding format."""

    name = ""
    refuses: tuple[str, ...] = ()
    groups = False  # consecutive files of this format share a unit (up to UNIT_BYTES, UNIT_FILES)
    prefix: str | None = None  # a streamed source: its specs start with this
    tokens = False  # its units are tokens already (then: tokenizer, vocab_size, eot_id, ...)
    conversations = False  # its records may hold conversations: records(), plan_file(chat=)
    only_conversations = False  # and nothing else (prepare --chat only)

    @property
    def described(self) -> str:
        """What sources of this format are, as a refusal says it ("the sources are ...")."""
        return f"{self.name} sources"

    def claims(self, path: Path) -> bool:
        return False

    def plan_file(self, path: Path, size: int, record: dict, text_field: str) -> list[Unit]:
        return [Unit(self.name, (str(path),))]

    def stream(self, spec: str) -> tuple:
        raise NotImplementedError(f"{self.name} is not a streamed source")

    def plan_stream(self, paths: tuple) -> list[Unit]:
        """A streamed source's units: one (a format may cut it, a unit per split)."""
        return [Unit(self.name, paths)]

    def stream_record(self, paths: tuple) -> dict:
        return {self.name: ":".join(p or "" for p in paths)}

    def where(self, unit: Unit) -> str:
        """How an error names the unit's source."""
        return str(unit.paths[0])

    def texts(self, unit: Unit, text_field: str, skip_bad: bool,
              stats: UnitStats) -> Iterator[str | None]:
        raise NotImplementedError(f"{self.name} has no texts")

    def records(self, unit: Unit, field: str, skip_bad: bool,
                stats: UnitStats) -> Iterator[tuple[str, object]]:
        raise NotImplementedError(f"{self.name} has no records")

    def pieces(self, unit: Unit, stats: UnitStats, text_field: str, skip_bad: bool,
               raw: bool) -> Iterator[tuple[bool, str | bytes]]:
        """The unit's documents as (begins a document, piece) pairs; `raw`: as UTF-8 bytes."""
        for text in self.texts(unit, text_field, skip_bad, stats):
            if not isinstance(text, str):
                columns.check_value(self.where(unit), text_field, text)
                stats.null_rows += 1  # a null in a text column: no document, counted
                continue
            if not text:
                stats.skipped_empty += 1
                continue
            stats.documents += 1
            text = clean(text, stats)
            piece_list = cut([text], PIECE_CHARS) if len(text) > PIECE_CHARS else [text]
            for i, piece in enumerate(piece_list):
                yield i == 0, piece.encode("utf-8") if raw else piece


def clean(text: str, stats: UnitStats) -> str:
    """A str from JSON may hold lone surrogates (`"\\ud800"`), which are no UTF-8: each becomes
    U+FFFD, counted."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        text, n = _SURROGATE.subn("\ufffd", text)
        stats.replaced += n
        return text


def first_line(e: BaseException) -> str:
    text = str(e).splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}: {text[:200]}" if text else type(e).__name__


def read_head(path: Path, n: int) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read(n)
    except OSError as e:
        raise UserError(f"{path}: cannot read it ({e.strerror}); check its permissions") from None


def cut(chunks: Iterable[str], size: int) -> Iterator[str]:
    """A document's text, given as chunks of any size, as pieces of 1 to `size` characters. A cut
    in a str falls between characters, so no UTF-8 character is ever split."""
    rest = ""
    for chunk in chunks:
        text, start = rest + chunk, 0
        while len(text) - start > size:
            end = _cut_point(text, start, start + size)
            yield text[start:end]
            start = end
        rest = text[start:]
    if rest:
        yield rest


def cut_bytes(chunks: Iterable[bytes], size: int) -> Iterator[bytes]:
    """A document's bytes, given as chunks of any size, as pieces of 1 to `size` bytes (the
    byte tokenizer: any cut keeps the tokens)."""
    for chunk in chunks:
        for start in range(0, len(chunk), size):
            yield chunk[start:start + size]


def _cut_point(text: str, start: int, end: int) -> int:
    """Where the piece text[start:end] ends: before the last newline in its second half that is
    followed by a non-space, else before the last such space or tab, else at `end` (a line of
    one word). The GPT-2 pre-tokenizer (bpe, gpt2) starts a pre-token at such a whitespace
    character, and the whitespace run before it ends one the same way at the end of the text, so
    the tokens on both sides are those of the uncut text."""
    window = text[(start + end) // 2:end][::-1]  # reversed: the first match is the last one
    match = _WORD_AFTER_NEWLINE.search(window) or _WORD_AFTER_SPACE.search(window)
    return end - 2 - match.start() if match else end

"""Text files: each file is one document (a .gz or .zst one decompressed: `notes.txt.gz`; a
.jsonl.gz is jsonl's). Invalid UTF-8 is decoded with replacement (counted) for
bpe and gpt2, kept exactly by the byte tokenizer; files with NUL bytes are skipped as binary, empty
ones as empty. A long file is scanned for NUL bytes first and decoded incrementally, in pieces of
at most `base.PIECE_CHARS`. Small files share a unit (up to `base.UNIT_BYTES` or
`base.UNIT_FILES`). Any file no other format claims is text.
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable, Iterator
from pathlib import Path

from ddpgpt.data.compressed import COMPRESSED, open_any
from ddpgpt.data.formats import base
from ddpgpt.data.formats.base import Format, Unit, UnitStats, first_line
from ddpgpt.errors import UserError


class Text(Format):
    name = "text"
    groups = True

    def pieces(self, unit: Unit, stats: UnitStats, text_field: str, skip_bad: bool,
               raw: bool) -> Iterator[tuple[bool, str | bytes]]:
        """`raw`: each file's bytes, exactly (the byte tokenizer); else its text, invalid UTF-8
        replaced (counted)."""
        for path in unit.paths:
            yield from _text_file(Path(path), stats, raw)


def _text_file(path: Path, stats: UnitStats, raw: bool) -> Iterator[tuple[bool, str | bytes]]:
    chunks = read_bytes_or_text(path, raw, stats)
    if chunks is None:
        stats.skipped_binary += 1
        return
    cut = base.cut_bytes if raw else base.cut
    first = True
    for piece in cut(chunks, base.PIECE_CHARS):
        yield first, piece
        first = False
    if first:
        stats.skipped_empty += 1
    else:
        stats.documents += 1


def read_bytes_or_text(path: Path, raw: bool, stats) -> Iterable[str | bytes] | None:
    """A text file's contents in chunks (a .gz or .zst one's decompressed), or None when it
    holds a NUL byte (binary). `raw`: its bytes, exactly; else its text, invalid UTF-8 replaced
    by U+FFFD and counted in `stats.replaced`."""
    compressed = path.name.lower().endswith(COMPRESSED)
    if not compressed and path.stat().st_size <= base.PIECE_CHARS:  # most files: one read
        data = path.read_bytes()
        if b"\x00" in data:
            return None
        return [data] if raw else [_decode_counted([data], stats)]
    if any(b"\x00" in block for block in _blocks(path)):
        return None
    return _blocks(path) if raw else _decode_counted(_blocks(path), stats, whole=False)


def _decode_counted(blocks: Iterable[bytes], stats, whole: bool = True):
    """`_decode`, counting the U+FFFD it puts in: those in the text less those in the bytes
    (a U+FFFD cut by a block boundary is found in the previous block's last 2 bytes + this)."""
    def counted():
        tail = b""
        for text, block in _decode_pairs(blocks):
            stats.replaced += text.count("\ufffd") - (tail + block).count(b"\xef\xbf\xbd")
            tail = block[-2:]
            yield text
    return "".join(counted()) if whole else counted()


def _decode_pairs(blocks: Iterable[bytes]) -> Iterator[tuple[str, bytes]]:
    """(text, block): UTF-8 decoding with replacement, exactly as of the whole: a character or
    an invalid sequence cut by a block boundary is completed from the next block."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    for block in blocks:
        yield decoder.decode(block), block
    yield decoder.decode(b"", final=True), b""


def _blocks(path: Path) -> Iterator[bytes]:
    try:
        with open_any(str(path)) as f:
            while block := f.read(base.PIECE_CHARS):
                yield block
    except (OSError, EOFError) as e:  # a compressed file cut short, or not what its name says
        raise UserError(f"{path}: cannot be read ({first_line(e)}); download it again or remove "
                        "it from the sources") from None


ROW = Text()

"""Resolving `prepare`'s sources (stdlib, files, directories, globs, hf:NAME) into a `Corpus`,
and reading a text file's document: its bytes, or its text in pieces of at most `PIECE_CHARS`.

Invalid UTF-8 is decoded with replacement (counted); files with NUL bytes are binary (the caller
skips them). A long file is scanned for NUL bytes first and decoded incrementally; `_cut_point`
cuts before a space or newline that starts a word whenever the piece has one, so that tokens
change only where a piece had to be cut inside a word. formats.py turns a corpus into units.
"""

from __future__ import annotations

import codecs
import glob
import os
import re
import sysconfig
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from ddpgpt.errors import UserError
from ddpgpt.files import require

PIECE_CHARS = 1 << 20  # a longer document is read and encoded in pieces of at most this
# On reversed text: a non-space then a newline (or any ASCII whitespace) is, read forwards, a
# whitespace character that starts a word: a cut before it keeps every pre-token (see _cut_point).
_WORD_AFTER_NEWLINE = re.compile(r"\S\n")
_WORD_AFTER_SPACE = re.compile(r"\S[\t\n\v\f\r ]")


@dataclass
class Corpus:
    """The resolved sources: local files (listed up front) and streamed HF datasets, in order.
    A file that two sources name (the same real path: `a.parquet` and its directory, a link and
    its target) is read once, where it is first named; `repeated` lists the later namings."""

    parts: list = field(default_factory=list)  # each a list[Path] or an (name, config, split) tuple
    specs: list[str] = field(default_factory=list)
    repeated: list[Path] = field(default_factory=list)

    def dedupe(self) -> None:
        seen: set = set()
        for i, part in enumerate(self.parts):
            if isinstance(part, tuple):  # an hf: dataset named twice is streamed twice no more
                self.parts[i] = None if part in seen else part
                seen.add(part)
                continue
            kept = []
            for path in part:
                real = os.path.realpath(path)
                if real in seen:
                    self.repeated.append(path)
                else:
                    seen.add(real)
                    kept.append(path)
            self.parts[i] = kept
        self.parts = [p for p in self.parts if p is not None]

    def repeated_note(self) -> str | None:
        """One line on the files read once though named more than once, or None."""
        if not self.repeated:
            return None
        n = len(self.repeated)
        return (f"ddpgpt: note: {n} file{'s are' if n > 1 else ' is'} named by more than one "
                f"source ({self.repeated[0]}{', ...' if n > 1 else ''}): each file is prepared "
                "once, where it is first named")


def read_bytes_or_text(path: Path, raw: bool, stats) -> Iterable[str | bytes] | None:
    """A text file's contents in chunks, or None when it holds a NUL byte (binary). `raw`: its
    bytes, exactly; else its text, invalid UTF-8 replaced by U+FFFD and counted in
    `stats.replaced`."""
    if path.stat().st_size <= PIECE_CHARS:  # most files: one read
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
    with open(path, "rb") as f:
        while block := f.read(PIECE_CHARS):
            yield block


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


_cut = cut


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


def hf_texts(name: str, config: str | None, split: str,
             text_field: str = "text") -> Iterator[str]:
    datasets = require("datasets", "hf", f"source hf:{name}")
    try:
        rows = datasets.load_dataset(name, config, split=split, streaming=True)
        for row in rows:
            if text_field not in row:
                raise UserError(f"hf:{name} rows have no {text_field!r} column (columns: "
                                f"{', '.join(row)}); name the text column with --text-field")
            yield row[text_field]
    except UserError:
        raise
    except Exception as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UserError(
            f"cannot stream hf:{name} ({first[:200]}); check the name and the network, "
            "or set HF_DATASETS_OFFLINE=1 to use a cached copy"
        ) from None


def stdlib_files() -> list[Path]:
    """The `.py` files of the running interpreter's standard library, site-packages excluded."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(
        p for p in root.rglob("*.py")
        if not {"site-packages", "dist-packages"} & set(p.relative_to(root).parts)
    )


def _walk(root: Path, exclude: list[Path]) -> list[Path]:
    """Every regular file below `root`, sorted, skipping hidden directories and `exclude`."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        dirnames[:] = sorted(
            d for d in dirnames if not d.startswith(".") and (here / d).resolve() not in exclude
        )
        out += [here / f for f in filenames if (here / f).is_file()]
    return sorted(out)  # path order, like the stdlib source: a/b.py < a/c/d.py < b.py


def resolve_sources(specs: list[str], exclude: list[Path]) -> Corpus:
    corpus = Corpus(specs=list(specs))
    for spec in specs:
        if spec == "stdlib":
            corpus.parts.append(stdlib_files())
        elif spec.startswith("hf:"):
            name, config, split = (spec[3:].split(":") + [None, None])[:3]
            if not name:
                raise UserError(f"source {spec!r}: expected hf:NAME[:CONFIG][:SPLIT]")
            corpus.parts.append((name, config or None, split or "train"))
        elif glob.has_magic(spec):
            matches = sorted(Path(m) for m in glob.glob(spec, recursive=True))
            if not matches:
                raise UserError(f"source {spec!r}: the pattern matches no files")
            corpus.parts.append([f for m in matches
                                 for f in (_walk(m, exclude) if m.is_dir() else [m])])
        else:
            path = Path(spec)
            if not path.exists():
                raise UserError(f"source {spec!r} does not exist; give a file, a directory, "
                                "a glob, stdlib or hf:NAME")
            corpus.parts.append(_walk(path, exclude) if path.is_dir() else [path])
    corpus.dedupe()
    return corpus



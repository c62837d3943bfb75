"""A corpus's documents: resolving `prepare`'s sources (stdlib, files, directories, globs,
hf:NAME) and reading each document as text, in pieces of at most `PIECE_CHARS` when it is long.

Invalid UTF-8 is decoded with replacement; files with NUL bytes are skipped as binary, empty ones
as empty (both counted in `Stats`). A long document is scanned for NUL bytes first and decoded
incrementally; `_cut_point` cuts before a space or newline that starts a word whenever the piece
has one, so that tokens change only where a piece had to be cut inside a word.
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

PIECE_CHARS = 1 << 20  # a longer document is read and encoded in pieces of at most this
# On reversed text: a non-space then a newline (or any ASCII whitespace) is, read forwards, a
# whitespace character that starts a word: a cut before it keeps every pre-token (see _cut_point).
_WORD_AFTER_NEWLINE = re.compile(r"\S\n")
_WORD_AFTER_SPACE = re.compile(r"\S[\t\n\v\f\r ]")


@dataclass
class Stats:
    documents: int = 0
    train_documents: int = 0
    val_documents: int = 0
    skipped_binary: int = 0
    skipped_empty: int = 0
    text_bytes: int = 0


@dataclass
class Corpus:
    """The resolved sources: local files (listed up front) and streamed HF datasets, in order."""

    parts: list = field(default_factory=list)  # each a list[Path] or an (name, config, split) tuple
    specs: list[str] = field(default_factory=list)

    @property
    def file_bytes(self) -> int | None:
        """Total size of the local files, or None when a streamed source makes it unknown."""
        if any(isinstance(p, tuple) for p in self.parts):
            return None
        return sum(f.stat().st_size for part in self.parts for f in part)

    def pieces(self, stats: Stats | None = None,
               limit_bytes: int | None = None) -> Iterator[tuple[bool, str]]:
        """Every document's text in pieces of at most PIECE_CHARS characters, each with True when
        it begins a document; binary and empty documents are skipped (counted in `stats`)."""
        seen = 0
        for chunks in self._documents():
            if chunks is None:
                if stats:
                    stats.skipped_binary += 1
                continue
            first = True
            for piece in _cut(chunks, PIECE_CHARS):
                yield first, piece
                first, seen = False, seen + len(piece)
                if limit_bytes is not None and seen >= limit_bytes:
                    return
            if first and stats:
                stats.skipped_empty += 1

    def texts(self, limit_bytes: int | None = None) -> Iterator[str]:
        """The pieces alone: what the bpe tokenizer is trained on."""
        return (piece for _, piece in self.pieces(limit_bytes=limit_bytes))

    def _documents(self) -> Iterator[Iterable[str] | None]:
        """Each document as chunks of its text, or None for a binary file."""
        for part in self.parts:
            if isinstance(part, tuple):
                yield from ([text] for text in _hf_texts(*part))
            else:
                yield from map(_read, part)


def _read(path: Path) -> Iterator[str] | None:
    """The file's text in chunks (invalid UTF-8 replaced), or None when it holds a NUL byte. A file
    larger than a piece is scanned for NUL first, then decoded as it is read, never whole."""
    if path.stat().st_size <= PIECE_CHARS:  # most files: one read
        data = path.read_bytes()
        return None if b"\x00" in data else iter([data.decode("utf-8", errors="replace")])
    if any(b"\x00" in block for block in _blocks(path)):
        return None
    return _decode(_blocks(path))


def _blocks(path: Path) -> Iterator[bytes]:
    with open(path, "rb") as f:
        while block := f.read(PIECE_CHARS):
            yield block


def _decode(blocks: Iterator[bytes]) -> Iterator[str]:
    """UTF-8 decoding with replacement, exactly as of the whole: a character or an invalid
    sequence cut by a block boundary is completed from the next block."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    for block in blocks:
        yield decoder.decode(block)
    yield decoder.decode(b"", final=True)


def _cut(chunks: Iterable[str], size: int) -> Iterator[str]:
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


def _cut_point(text: str, start: int, end: int) -> int:
    """Where the piece text[start:end] ends: before the last newline in its second half that is
    followed by a non-space, else before the last such space or tab, else at `end` (a line of
    one word). The GPT-2 pre-tokenizer (bpe, gpt2) starts a pre-token at such a whitespace
    character, and the whitespace run before it ends one the same way at the end of the text, so
    the tokens on both sides are those of the uncut text."""
    window = text[(start + end) // 2:end][::-1]  # reversed: the first match is the last one
    match = _WORD_AFTER_NEWLINE.search(window) or _WORD_AFTER_SPACE.search(window)
    return end - 2 - match.start() if match else end


def _hf_texts(name: str, config: str | None, split: str) -> Iterator[str]:
    try:
        import datasets
    except ImportError:
        raise UserError(f"source hf:{name} needs the 'hf' extra: "
                        "pip install 'ddpgpt[hf]'") from None
    try:
        rows = datasets.load_dataset(name, config, split=split, streaming=True)
        for row in rows:
            if "text" not in row:
                raise UserError(f"hf:{name} rows have no 'text' column (columns: {', '.join(row)})")
            yield row["text"]
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
    return corpus



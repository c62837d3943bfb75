"""Resolving `prepare`'s sources (stdlib, files, directories, globs, a streamed format's spec
such as hf:NAME) into a `Corpus`; formats/table.py turns a corpus into units."""

from __future__ import annotations

import glob
import os
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

from ddpgpt.data.formats.table import Stream, streamed
from ddpgpt.errors import UserError


@dataclass
class Corpus:
    """The resolved sources: local files (listed up front) and streamed HF datasets, in order.
    A file that two sources name (the same real path: `a.parquet` and its directory, a link and
    its target) is read once, where it is first named; `repeated` lists the later namings."""

    parts: list = field(default_factory=list)  # each a list[Path] or a table.Stream
    specs: list[str] = field(default_factory=list)
    repeated: list[Path] = field(default_factory=list)

    def dedupe(self) -> None:
        seen: set = set()
        for i, part in enumerate(self.parts):
            if isinstance(part, Stream):  # a dataset named twice is streamed twice no more
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
        elif (row := streamed(spec)) is not None:
            corpus.parts.append(Stream(row.name, row.stream(spec)))
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



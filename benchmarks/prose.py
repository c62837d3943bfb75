"""Corpora of English prose from text a Debian machine has, each cut into its sections and those
into runs of paragraphs of at most 4 KB, one document each, so that a 1% validation split holds
whole pieces from all over it:

    prose   Vim's help (the vim-runtime package, /usr/share/vim/vim*/doc/*.txt: the user manual
            and the reference, ~9.4 MB); a section ends at a line of 70 or more `=` (Vim help's
            separator), and the separator lines are dropped
    perl    Perl's documentation (the perl-doc package, /usr/share/perl/5*/pod/*.pod: the manual
            pages, perlfunc, perlop, the FAQ, ~9 MB of POD); a section starts at each `=head1`
            or `=head2` line, which it keeps

    python -m benchmarks.prose --out data/vimhelp
    python -m benchmarks.prose --source perl --out data/perldoc
    ddpgpt prepare data/vimhelp/vimhelp.jsonl --out data/prose   # the jsonl alone, not SOURCES.txt
    python -m benchmarks.speedrun --corpus prose         # builds it under the work dir itself

A section is cut at blank lines into pieces of at most 4,096 characters (a longer paragraph
stays whole), and blank pieces are dropped. The files are read in sorted order as UTF-8 (a
byte that is not, replaced), so the same package gives the same corpus byte for byte:
`DIR/<name>.jsonl` (one {"text": ...} per piece) and `DIR/SOURCES.txt` (the package version
where dpkg knows it, and each file's size and sha256); a file whose bytes would not change is
left untouched.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

PIECE = 4096


@dataclass(frozen=True)
class Source:
    files: str       # a glob
    separator: str   # a regex, multi-line: where sections split (what it matches is dropped)
    package: str     # the Debian package holding the files
    name: str        # the jsonl's name


SOURCES = {
    "prose": Source("/usr/share/vim/vim*/doc/*.txt", r"^={70,}[ \t]*\n", "vim-runtime",
                    "vimhelp"),
    "perl": Source("/usr/share/perl/5*/pod/*.pod", r"^(?==head[12]\b)", "perl-doc", "perldoc"),
}


def sections(text: str, most: int = PIECE, separator: str = SOURCES["prose"].separator
             ) -> list[str]:
    """The text cut at its separator (what it matches dropped, and blank sections with it), each
    section then into runs of whole paragraphs of at most `most` characters (a longer paragraph
    whole)."""
    out = []
    for section in re.split(separator, text, flags=re.M):
        piece = ""
        for para in re.split(r"(?<=\n\n)", section):  # each paragraph keeps its blank line
            if piece and len(piece) + len(para) > most:
                out.append(piece)
                piece = ""
            piece += para
        out.append(piece)
    return [piece for piece in out if piece.strip()]


def build(out: Path, pattern: str | None = None, source: str = "prose") -> Path:
    """Write DIR/<name>.jsonl and DIR/SOURCES.txt for SOURCES[source] (its files, or those
    `pattern` matches); the jsonl's path. SystemExit in one line when no file matches (the
    package is not installed)."""
    src = SOURCES[source]
    pattern = pattern or src.files
    files = {}
    for path in sorted(Path(p) for p in glob.glob(pattern)):  # one copy each (5.36 -> 5.36.0)
        files.setdefault(path.resolve(), path)
    files = list(files.values())
    if not files:
        raise SystemExit(f"prose: no file matches {pattern}; install Debian's {src.package} "
                         f"(apt-get install {src.package}) or give --files")
    out.mkdir(parents=True, exist_ok=True)
    corpus, listing, count = out / f"{src.name}.jsonl", [], 0
    with open(corpus.with_suffix(".partial"), "w", encoding="utf-8") as f:
        for path in files:
            raw = path.read_bytes()
            listing.append(f"{hashlib.sha256(raw).hexdigest()}  {len(raw):>8}  {path}")
            for part in sections(raw.decode("utf-8", errors="replace"),
                                 separator=src.separator):
                f.write(json.dumps({"text": part}, ensure_ascii=False) + "\n")
                count += 1
    _replace_if_changed(corpus.with_suffix(".partial"), corpus)
    sources = out / "SOURCES.partial"
    sources.write_text(f"{count} pieces of {len(files)} files ({pattern}); "
                       f"{_package_version(src.package)}\n" + "\n".join(listing) + "\n")
    _replace_if_changed(sources, out / "SOURCES.txt")
    return corpus


def _replace_if_changed(new: Path, path: Path) -> None:
    """`new` onto `path`, unless `path` holds the same bytes already: then it is left as it was
    (its mtime too, which tells benchmarks/speedrun.py whether to prepare the corpus again)."""
    if path.is_file() and path.read_bytes() == new.read_bytes():
        new.unlink()
    else:
        new.replace(path)


def _package_version(package: str) -> str:
    try:
        done = subprocess.run(["dpkg-query", "-W", "-f", "${Package} ${Version}", package],
                              capture_output=True, text=True)
    except OSError:
        return "dpkg not found"
    return done.stdout.strip() if done.returncode == 0 else f"{package} not known to dpkg"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="the directory to write")
    parser.add_argument("--source", default="prose", choices=tuple(SOURCES))
    parser.add_argument("--files", default=None, help="the source's files (a glob)")
    args = parser.parse_args()
    corpus = build(Path(args.out), args.files, args.source)
    print(f"written: {corpus} ({(Path(args.out) / 'SOURCES.txt').read_text().splitlines()[0]})")


if __name__ == "__main__":
    main()

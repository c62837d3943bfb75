"""A corpus of English prose from text a Debian machine has: Vim's help (the vim-runtime package,
/usr/share/vim/vim*/doc/*.txt: the user manual and the reference, ~9.4 MB), cut into its
sections and those into runs of paragraphs of at most 4 KB, one document each, so that a 1%
validation split holds ~90 KB of whole pieces from all over it.

    python -m benchmarks.prose --out data/vimhelp
    ddpgpt prepare data/vimhelp/vimhelp.jsonl --out data/prose   # the jsonl alone, not SOURCES.txt
    python -m benchmarks.speedrun --corpus prose         # builds it under the work dir itself

A section ends at a line of 70 or more `=` (Vim help's separator); the separator lines are dropped,
a section is cut at blank lines into pieces of at most 4,096 characters (a longer paragraph
stays whole), and blank pieces are dropped. The files are read in sorted order as UTF-8 (a
byte that is not, replaced), so the same vim-runtime gives the same corpus byte for byte:
`DIR/vimhelp.jsonl` (one {"text": ...} per piece) and `DIR/SOURCES.txt` (the package version
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
from pathlib import Path

FILES = "/usr/share/vim/vim*/doc/*.txt"
SEPARATOR = re.compile(r"^={70,}[ \t]*\n", re.M)
PIECE = 4096


def sections(text: str, most: int = PIECE) -> list[str]:
    """The text cut at its separator lines (dropped, and blank sections with them), each section
    then into runs of whole paragraphs of at most `most` characters (a longer paragraph whole)."""
    out = []
    for section in SEPARATOR.split(text):
        piece = ""
        for para in re.split(r"(?<=\n\n)", section):  # each paragraph keeps its blank line
            if piece and len(piece) + len(para) > most:
                out.append(piece)
                piece = ""
            piece += para
        out.append(piece)
    return [piece for piece in out if piece.strip()]


def build(out: Path, pattern: str = FILES) -> Path:
    """Write DIR/vimhelp.jsonl and DIR/SOURCES.txt; the jsonl's path. SystemExit in one line when
    no file matches (vim-runtime is not installed)."""
    files = sorted(Path(p) for p in glob.glob(pattern))
    if not files:
        raise SystemExit(f"prose: no file matches {pattern}; install Debian's vim-runtime "
                         "(apt-get install vim-runtime) or give --files")
    out.mkdir(parents=True, exist_ok=True)
    corpus, listing, count = out / "vimhelp.jsonl", [], 0
    with open(corpus.with_suffix(".partial"), "w", encoding="utf-8") as f:
        for path in files:
            raw = path.read_bytes()
            listing.append(f"{hashlib.sha256(raw).hexdigest()}  {len(raw):>8}  {path}")
            for part in sections(raw.decode("utf-8", errors="replace")):
                f.write(json.dumps({"text": part}, ensure_ascii=False) + "\n")
                count += 1
    _replace_if_changed(corpus.with_suffix(".partial"), corpus)
    sources = out / "SOURCES.partial"
    sources.write_text(f"{count} pieces of {len(files)} files ({pattern}); "
                       f"{_package_version()}\n" + "\n".join(listing) + "\n")
    _replace_if_changed(sources, out / "SOURCES.txt")
    return corpus


def _replace_if_changed(new: Path, path: Path) -> None:
    """`new` onto `path`, unless `path` holds the same bytes already: then it is left as it was
    (its mtime too, which tells benchmarks/speedrun.py whether to prepare the corpus again)."""
    if path.is_file() and path.read_bytes() == new.read_bytes():
        new.unlink()
    else:
        new.replace(path)


def _package_version() -> str:
    try:
        done = subprocess.run(["dpkg-query", "-W", "-f", "${Package} ${Version}", "vim-runtime"],
                              capture_output=True, text=True)
    except OSError:
        return "dpkg not found"
    return done.stdout.strip() if done.returncode == 0 else "vim-runtime not known to dpkg"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="the directory to write")
    parser.add_argument("--files", default=FILES, help="the help files (a glob)")
    args = parser.parse_args()
    corpus = build(Path(args.out), args.files)
    print(f"written: {corpus} ({(Path(args.out) / 'SOURCES.txt').read_text().splitlines()[0]})")


if __name__ == "__main__":
    main()

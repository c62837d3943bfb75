"""`ddpgpt prepare`: turn a text corpus into token shards that training processes memory-map.

    ddpgpt prepare --out data/stdlib                  # the Python standard library, bpe 4096
    ddpgpt prepare notes/ 'books/**/*.txt' --out data/mine --tokenizer byte
    ddpgpt prepare hf:roneneldan/TinyStories --out data/ts --tokenizer gpt2   # needs the hf extra
    ddpgpt prepare --verify data/stdlib                # re-hash every shard against meta.json

Each file (or dataset row) is one document. Invalid UTF-8 is decoded with replacement; files with
NUL bytes are skipped as binary, empty ones as empty, and both are counted in the summary. Every
document is preceded by the end-of-text token, so the stream reads EOT doc EOT doc ... and a
model sampled from EOT starts a fresh document.

The pipeline streams: documents are read, encoded in batches (the tokenizer uses every core) and
appended to the shard files, so memory stays bounded whatever the corpus size. A document longer
than `PIECE_CHARS` is read and encoded in pieces, so that holds per document too: the byte
stream is the same whatever the pieces, and a bpe or gpt2 token can change only where a piece had
to be cut inside a word (`_cut_point` cuts before a space or newline that starts a word whenever
the piece has one, and there the tokens are exactly those of the whole text). The bpe tokenizer is
trained first, on at most `bpe_train_mb` of the corpus.

Output goes to `.NAME.partial-PID` beside `--out`, renamed to `--out` only when complete;
`meta.json` describes it (see `shards.py`). SIGTERM and SIGHUP remove the partial and exit
128 + N; a partial left by a prepare that died (SIGKILL, power loss) is removed by the next prepare
into the same `--out` once its PID is no longer alive.
"""

from __future__ import annotations

import codecs
import glob
import json
import os
import re
import shutil
import signal
import sys
import sysconfig
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import suppress
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from tqdm import tqdm

from ddpgpt import __version__
from ddpgpt.config import PrepareConfig
from ddpgpt.data.shards import (
    META_FORMAT_VERSION,
    ShardInfo,
    ShardWriter,
    TokenDataset,
    dtype_for_vocab,
)
from ddpgpt.data.tokenizer import BPETokenizer, ByteTokenizer, GPT2Tokenizer
from ddpgpt.errors import UserError, warn
from ddpgpt.files import pid_alive

BATCH_BYTES = 4 << 20  # text per encode_batch call: large enough to keep both cores busy
PIECE_CHARS = 1 << 20  # a longer document is read and encoded in pieces of at most this
PID_LIMIT = 1 << 22  # Linux's largest pid_max: a bigger number in a partial's name is no PID
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


def is_val(index: int, fraction_ppm: int) -> bool:
    """Document `index` goes to validation: ceil(n·f) of the first n documents do, evenly spaced,
    starting with document 0, so even a corpus of two documents gets one in each split."""
    def ceil_div(a: int) -> int:
        return -(-a // 1_000_000)
    return ceil_div((index + 1) * fraction_ppm) > ceil_div(index * fraction_ppm)


class SplitWriter:
    """Appends tokens to `{split}_NNNNNN.bin` shards of at most `shard_tokens` tokens each."""

    def __init__(self, out_dir: Path, split: str, dtype: str, shard_tokens: int):
        self.out_dir, self.split, self.dtype = out_dir, split, dtype
        self.shard_tokens = shard_tokens
        self.infos: list[ShardInfo] = []
        self._writer: ShardWriter | None = None

    def write(self, tokens: np.ndarray) -> None:
        while len(tokens):
            if self._writer is None:
                name = f"{self.split}_{len(self.infos):06d}.bin"
                self._writer = ShardWriter(self.out_dir / name, self.dtype)
            room = self.shard_tokens - self._writer.count
            self._writer.write(tokens[:room])
            tokens = tokens[room:]
            if self._writer.count == self.shard_tokens:
                self.infos.append(self._writer.close())
                self._writer = None

    def close(self) -> list[ShardInfo]:
        if self._writer is not None:
            self.infos.append(self._writer.close())
            self._writer = None
        return self.infos


def _batches(pieces: Iterator[tuple[bool, str]]) -> Iterator[list[tuple[bool, str]]]:
    batch, size = [], 0
    for piece in pieces:
        batch.append(piece)
        size += len(piece[1])
        if size >= BATCH_BYTES:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def make_tokenizer(cfg: PrepareConfig, corpus: Corpus):
    if cfg.tokenizer == "byte":
        return ByteTokenizer()
    if cfg.tokenizer == "gpt2":
        return GPT2Tokenizer()
    limit = cfg.bpe_train_mb << 20
    return BPETokenizer.train(corpus.texts(limit_bytes=limit), cfg.vocab_size,
                              show_progress=sys.stderr.isatty())


def write_dataset(cfg: PrepareConfig, corpus: Corpus, tok, out: Path) -> tuple[Stats, dict]:
    """The encode pass: documents -> EOT-separated token stream -> train/val shards in `out`."""
    stats = Stats()
    dtype = dtype_for_vocab(tok.vocab_size)
    writers = {s: SplitWriter(out, s, dtype, cfg.shard_tokens) for s in ("train", "val")}
    ppm = round(cfg.val_fraction * 1_000_000)
    eot = np.array([tok.eot_id], dtype=np.uint32)
    split = "train"  # of the document being written: its pieces may span batches
    bar = tqdm(total=corpus.file_bytes, unit="B", unit_scale=True, desc="tokenize", disable=None)
    for batch in _batches(corpus.pieces(stats)):
        arrays = {"train": [], "val": []}
        encoded = tok.encode_batch([text for _, text in batch])
        for (first, _), ids in zip(batch, encoded, strict=True):
            if first:  # one EOT per document, not per piece
                split = _count_document(stats, ppm)
                arrays[split].append(eot)
            arrays[split].append(ids)
        for name, parts in arrays.items():
            if parts:
                writers[name].write(np.concatenate(parts))
        size = sum(len(text.encode("utf-8", "surrogatepass")) for _, text in batch)
        stats.text_bytes += size
        bar.update(size)
    bar.close()
    shards = {s: w.close() for s, w in writers.items()}
    _check_splits(cfg, corpus, stats)
    source = {"specs": corpus.specs, "val_fraction": cfg.val_fraction, "stats": asdict(stats)}
    return stats, make_meta(tok, dtype, shards, source)


def _count_document(stats: Stats, ppm: int) -> str:
    """Counts the next document in `stats`; returns the split it goes to."""
    split = "val" if is_val(stats.documents, ppm) else "train"
    stats.documents += 1
    if split == "val":
        stats.val_documents += 1
    else:
        stats.train_documents += 1
    return split


def _check_splits(cfg: PrepareConfig, corpus: Corpus, stats: Stats) -> None:
    if stats.documents == 0:
        raise UserError(f"no documents in {' '.join(corpus.specs)} ({stats.skipped_binary} binary "
                        f"and {stats.skipped_empty} empty files skipped); give a source with text")
    if stats.train_documents == 0 or stats.val_documents == 0:
        empty = "training" if stats.train_documents == 0 else "validation"
        raise UserError(f"the {empty} split is empty ({stats.documents} documents, --val-fraction "
                        f"{cfg.val_fraction}); give more documents or change --val-fraction")


def make_meta(tok, dtype: str, shards: dict[str, list[ShardInfo]], source: dict) -> dict:
    """The contents of a dataset's meta.json (read back by `shards.TokenDataset`)."""
    return {
        "format_version": META_FORMAT_VERSION,
        "tokenizer": tok.kind,
        "vocab_size": tok.vocab_size,
        "eot_id": tok.eot_id,
        "dtype": dtype,
        "shards": {s: [asdict(i) for i in infos] for s, infos in shards.items()},
        "source": source,
        "created_by": f"ddpgpt {__version__}",
    }


def _check_out(out: Path, force: bool) -> None:
    """Refuses an --out that cannot become the dataset directory, before anything is created."""
    if out.name in ("", ".."):  # "/", ".", "..": no name to give the partial and to rename to
        raise UserError(f"--out {out} is not a directory name; give a path that ends in one, "
                        "e.g. --out data/mine")
    try:
        if out.exists() and not out.is_dir():
            raise UserError(f"--out {out} is a file; give a directory")
        if out.is_dir() and any(out.iterdir()) and not force:
            raise UserError(f"--out {out} exists and is not empty; pass --force to replace it")
        above = next(p for p in out.parents if p.exists())  # "." or "/" at the latest
    except OSError as e:  # a parent this user may not search or list
        raise _unwritable(out, e) from None
    if not above.is_dir():
        raise UserError(f"--out {out}: {above} is a file, not a directory; give an --out whose "
                        "parents are directories")


def _unwritable(out: Path, e: OSError) -> UserError:
    where = Path(e.filename).parent if e.filename else out.parent
    return UserError(f"--out {out}: cannot write in {where} ({e.strerror}); give a directory you "
                     "can write to")


def _make_partial(out: Path, tmp: Path, made: list[Path]) -> None:
    """Creates the missing parents of --out, then the partial directory `tmp`, appending each to
    `made` (for the clean-up); partials that dead prepares left for this --out go first."""
    try:
        for parent in reversed([p for p in out.parents if not p.exists()]):
            parent.mkdir()
            made.append(parent)
        _remove_stale_partials(tmp)
        tmp.mkdir()
        made.append(tmp)
    except OSError as e:
        raise _unwritable(out, e) from None


def _remove_stale_partials(tmp: Path) -> None:
    """Removes `.NAME.partial-PID` directories of this --out NAME whose PID is not alive. A PID
    that is alive keeps its partial, whatever process has it now: a running prepare into this
    --out never loses its output."""
    prefix = tmp.name[:tmp.name.rindex("-") + 1]
    for path in tmp.parent.glob(glob.escape(prefix) + "*"):
        pid = path.name[len(prefix):]
        if _stale(pid):
            shutil.rmtree(path, ignore_errors=True)
            warn(f"removed {path}, the partial output of a prepare (pid {pid}) "
                 "that is no longer running")


def _stale(pid: str) -> bool:
    """`pid` (from a partial's name) is no running prepare: not alive, or our own, which is
    about to make its partial and so cannot have one yet."""
    if not pid.isdigit() or int(pid) >= PID_LIMIT:
        return False  # not a name prepare makes
    return int(pid) == os.getpid() or not pid_alive(int(pid))


def _publish(tmp: Path, out: Path) -> None:
    """Renames the finished `tmp` to `out`; an old `out` is moved aside first, deleted last."""
    old = None
    if out.exists():
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        try:
            os.rename(out, old)
        except OSError as e:  # e.g. a mount point: the old --out stays as it was
            raise UserError(f"--out {out}: cannot move it aside to replace it ({e.strerror}); "
                            "remove it yourself or give another --out") from None
    os.rename(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


class Terminated(UserError):
    """prepare stopped by SIGTERM or SIGHUP after removing its partial output; exits 128 + N,
    as the signal would have."""

    label = "stopped"

    def __init__(self, signum: int, message: str):
        super().__init__(f"{signal.Signals(signum).name} {message}")
        self.exit_code = 128 + signum


class _Signalled(BaseException):
    """Raised by the handler: a BaseException, so no library's `except Exception` swallows it."""


class CleanExit:
    """For the duration of a `with`: SIGTERM and SIGHUP raise, so `finally` blocks run and remove
    the partial output (by default the signals end the process on the spot and leave it), and
    leave the block as `Terminated(message)`. After `hold()` a signal waits instead, and is sent
    again once the previous handlers are back at the end of the block."""

    SIGNALS = (signal.SIGTERM, signal.SIGHUP)

    def __init__(self, message: str):
        self.message, self.holding, self.pending = message, False, None
        self._previous: dict = {}

    def _handle(self, signum, frame) -> None:
        if self.holding:
            self.pending = signum
            return
        for sig in self.SIGNALS:
            signal.signal(sig, signal.SIG_IGN)  # a second signal must not cut the clean-up short
        raise _Signalled(signum)

    def __enter__(self) -> CleanExit:
        if threading.current_thread() is threading.main_thread():  # only it may set handlers
            self._previous = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}
        return self

    def __exit__(self, kind, exc, tb) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        if isinstance(exc, _Signalled):
            raise Terminated(exc.args[0], self.message) from None
        if self.pending is not None:
            os.kill(os.getpid(), self.pending)

    def hold(self) -> None:
        self.holding = True


def verify(path: Path) -> None:
    ds = TokenDataset(path)
    n = ds.verify()
    print(f"{path}: ok ({n} shards, {ds.num_tokens('train'):,} train + {ds.num_tokens('val'):,} "
          f"val tokens, {ds.tokenizer} vocab {ds.vocab_size})")


def run(cfg: PrepareConfig) -> None:
    if cfg.verify is not None:
        return verify(Path(cfg.verify))
    if cfg.out is None:
        raise UserError("ddpgpt prepare needs --out DIR (or --verify DIR)")
    out = Path(cfg.out)
    _check_out(out, cfg.force)
    tmp = out.with_name(f".{out.name}.partial-{os.getpid()}")
    corpus = resolve_sources(cfg.sources or ["stdlib"], exclude=[out.resolve(), tmp.resolve()])
    start = time.perf_counter()
    made: list[Path] = []
    stopped = (f"before prepare finished; removed the partial output {tmp} (--out {out} is "
               "unchanged); run the same command again to prepare it")
    with CleanExit(stopped) as signals:
        try:
            _make_partial(out, tmp, made)
            stats, meta = _build(cfg, corpus, tmp)
            _check_out(out, cfg.force)
            signals.hold()  # from here the dataset is published whatever comes: a signal
            _publish(tmp, out)  # between its two renames would lose the old --out
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
            for path in reversed(made):  # parents made for a failed run; after a publish they
                with suppress(OSError):  # hold --out, and rmdir removes only empty directories
                    path.rmdir()
    _summary(out, stats, meta, time.perf_counter() - start)


def _build(cfg: PrepareConfig, corpus: Corpus, tmp: Path) -> tuple[Stats, dict]:
    tok = make_tokenizer(cfg, corpus)
    stats, meta = write_dataset(cfg, corpus, tok, tmp)
    tok.save(tmp)
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")  # last: marks complete
    return stats, meta


def _summary(out: Path, stats: Stats, meta: dict, seconds: float) -> None:
    tokens = {s: sum(i["tokens"] for i in meta["shards"][s]) for s in ("train", "val")}
    total = tokens["train"] + tokens["val"]
    size = sum(f.stat().st_size for f in out.iterdir())
    print(
        f"prepared {out}: {stats.documents:,} documents ({stats.train_documents:,} train, "
        f"{stats.val_documents:,} val), {total:,} tokens ({tokens['train']:,} train, "
        f"{tokens['val']:,} val), {meta['tokenizer']} vocab {meta['vocab_size']}\n"
        f"skipped {stats.skipped_binary} binary and {stats.skipped_empty} empty files; "
        f"{stats.text_bytes / 1e6:.1f} MB of text in {seconds:.1f} s "
        f"({total / seconds / 1e6:.2f}M tokens/s); output {size / 1e6:.1f} MB"
    )

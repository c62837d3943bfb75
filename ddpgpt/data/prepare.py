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
appended to the shard files, so memory stays bounded whatever the corpus size. The bpe tokenizer
is trained first, on at most `bpe_train_mb` of the corpus. Output goes to a temporary directory
that is renamed to `--out` only when complete; `meta.json` describes it (see `shards.py`).
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import sys
import sysconfig
import time
from collections.abc import Iterator
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
from ddpgpt.errors import UserError

BATCH_BYTES = 4 << 20  # text per encode_batch call: large enough to keep both cores busy


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

    def texts(self, stats: Stats | None = None, limit_bytes: int | None = None) -> Iterator[str]:
        """Yields each document's text, skipping binary and empty ones (counted in `stats`)."""
        seen = 0
        for part in self.parts:
            docs = _hf_texts(*part) if isinstance(part, tuple) else (_read(f) for f in part)
            for raw in docs:
                if raw is None:
                    if stats:
                        stats.skipped_binary += 1
                    continue
                if not raw:
                    if stats:
                        stats.skipped_empty += 1
                    continue
                yield raw
                seen += len(raw)
                if limit_bytes is not None and seen >= limit_bytes:
                    return


def _read(path: Path) -> str | None:
    data = path.read_bytes()
    if b"\x00" in data:
        return None  # binary
    return data.decode("utf-8", errors="replace")


def _hf_texts(name: str, config: str | None, split: str) -> Iterator[str]:
    try:
        import datasets
    except ImportError:
        raise UserError(f"source hf:{name} needs the 'hf' extra: pip install 'ddpgpt[hf]'") from None
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
            corpus.parts.append([f for m in matches for f in (_walk(m, exclude) if m.is_dir() else [m])])
        else:
            path = Path(spec)
            if not path.exists():
                raise UserError(f"source {spec!r} does not exist; give a file, a directory, a glob, stdlib or hf:NAME")
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
        self.out_dir, self.split, self.dtype, self.shard_tokens = out_dir, split, dtype, shard_tokens
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


def _batches(texts: Iterator[str]) -> Iterator[list[str]]:
    batch, size = [], 0
    for text in texts:
        batch.append(text)
        size += len(text)
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
    return BPETokenizer.train(corpus.texts(limit_bytes=limit), cfg.vocab_size, show_progress=sys.stderr.isatty())


def write_dataset(cfg: PrepareConfig, corpus: Corpus, tok, out: Path) -> tuple[Stats, dict]:
    """The encode pass: documents -> EOT-separated token stream -> train/val shards in `out`."""
    stats = Stats()
    dtype = dtype_for_vocab(tok.vocab_size)
    writers = {s: SplitWriter(out, s, dtype, cfg.shard_tokens) for s in ("train", "val")}
    ppm = round(cfg.val_fraction * 1_000_000)
    eot = np.array([tok.eot_id], dtype=np.uint32)
    bar = tqdm(total=corpus.file_bytes, unit="B", unit_scale=True, desc="tokenize", disable=None)
    for batch in _batches(corpus.texts(stats)):
        pieces = {"train": [], "val": []}
        for ids in tok.encode_batch(batch):
            split = "val" if is_val(stats.documents, ppm) else "train"
            pieces[split] += [eot, ids]
            stats.documents += 1
            if split == "val":
                stats.val_documents += 1
            else:
                stats.train_documents += 1
        for split, arrays in pieces.items():
            if arrays:
                writers[split].write(np.concatenate(arrays))
        size = sum(len(t.encode("utf-8", "surrogatepass")) for t in batch)
        stats.text_bytes += size
        bar.update(size)
    bar.close()
    shards = {s: w.close() for s, w in writers.items()}
    if stats.documents == 0:
        raise UserError(f"no documents in {' '.join(corpus.specs)} ({stats.skipped_binary} binary and "
                        f"{stats.skipped_empty} empty files skipped); give a source with text")
    if stats.train_documents == 0 or stats.val_documents == 0:
        empty = "training" if stats.train_documents == 0 else "validation"
        raise UserError(
            f"the {empty} split is empty ({stats.documents} documents, --val-fraction {cfg.val_fraction}); "
            "give more documents or change --val-fraction"
        )
    source = {"specs": corpus.specs, "val_fraction": cfg.val_fraction, "stats": asdict(stats)}
    return stats, make_meta(tok, dtype, shards, source)


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
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file; give a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise UserError(f"--out {out} exists and is not empty; pass --force to replace it")


def _publish(tmp: Path, out: Path) -> None:
    """Renames the finished `tmp` to `out`; an old `out` is moved aside first, deleted last."""
    old = None
    if out.exists():
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        os.rename(out, old)
    os.rename(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def verify(path: Path) -> None:
    ds = TokenDataset(path)
    n = ds.verify()
    print(f"{path}: ok ({n} shards, {ds.num_tokens('train'):,} train + {ds.num_tokens('val'):,} val tokens, "
          f"{ds.tokenizer} vocab {ds.vocab_size})")


def run(cfg: PrepareConfig) -> None:
    if cfg.verify is not None:
        return verify(Path(cfg.verify))
    if cfg.out is None:
        raise UserError("ddpgpt prepare needs --out DIR (or --verify DIR)")
    out = Path(cfg.out)
    _check_out(out, cfg.force)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.partial-{os.getpid()}")
    corpus = resolve_sources(cfg.sources or ["stdlib"], exclude=[out.resolve(), tmp.resolve()])
    start = time.perf_counter()
    tmp.mkdir()
    try:
        tok = make_tokenizer(cfg, corpus)
        stats, meta = write_dataset(cfg, corpus, tok, tmp)
        tok.save(tmp)
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")  # last: marks complete
        _check_out(out, cfg.force)
        _publish(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _summary(out, stats, meta, time.perf_counter() - start)


def _summary(out: Path, stats: Stats, meta: dict, seconds: float) -> None:
    tokens = {s: sum(i["tokens"] for i in meta["shards"][s]) for s in ("train", "val")}
    total = tokens["train"] + tokens["val"]
    size = sum(f.stat().st_size for f in out.iterdir())
    print(
        f"prepared {out}: {stats.documents:,} documents ({stats.train_documents:,} train, "
        f"{stats.val_documents:,} val), {total:,} tokens ({tokens['train']:,} train, {tokens['val']:,} val), "
        f"{meta['tokenizer']} vocab {meta['vocab_size']}\n"
        f"skipped {stats.skipped_binary} binary and {stats.skipped_empty} empty files; "
        f"{stats.text_bytes / 1e6:.1f} MB of text in {seconds:.1f} s ({total / seconds / 1e6:.2f}M tokens/s); "
        f"output {size / 1e6:.1f} MB"
    )

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
than `sources.PIECE_CHARS` is read and encoded in pieces, so that holds per document too: the byte
stream is the same whatever the pieces, and a bpe or gpt2 token can change only where a piece had
to be cut inside a word (`_cut_point` cuts before a space or newline that starts a word whenever
the piece has one, and there the tokens are exactly those of the whole text). The bpe tokenizer is
trained first, on at most `bpe_train_mb` of the corpus.

Output goes to `.NAME.partial-PID` beside `--out`, renamed to `--out` only when complete;
`meta.json` describes it (see `shards.py`); output.py handles --out, the partial and signals.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from collections.abc import Iterator
from contextlib import suppress
from dataclasses import asdict
from pathlib import Path

import numpy as np
from tqdm import tqdm

from ddpgpt import __version__
from ddpgpt.config.commands import PrepareConfig
from ddpgpt.data.output import CleanExit, check_out, make_partial, publish
from ddpgpt.data.shards import (
    META_FORMAT_VERSION,
    ShardInfo,
    ShardWriter,
    TokenDataset,
    dtype_for_vocab,
)
from ddpgpt.data.sources import Corpus, Stats, resolve_sources
from ddpgpt.data.tokenizer import BPETokenizer, ByteTokenizer, GPT2Tokenizer
from ddpgpt.errors import UserError

BATCH_BYTES = 4 << 20  # text per encode_batch call: large enough to keep both cores busy


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
    split_bytes = {"train": 0, "val": 0}  # UTF-8 bytes of text per split: for bits per byte
    bar = tqdm(total=corpus.file_bytes, unit="B", unit_scale=True, desc="tokenize", disable=None)
    for batch in _batches(corpus.pieces(stats)):
        arrays = {"train": [], "val": []}
        encoded = tok.encode_batch([text for _, text in batch])
        size = 0
        for (first, text), ids in zip(batch, encoded, strict=True):
            if first:  # one EOT per document, not per piece
                split = _count_document(stats, ppm)
                arrays[split].append(eot)
            arrays[split].append(ids)
            piece_bytes = len(text.encode("utf-8", "surrogatepass"))
            split_bytes[split] += piece_bytes
            size += piece_bytes
        for name, parts in arrays.items():
            if parts:
                writers[name].write(np.concatenate(parts))
        stats.text_bytes += size
        bar.update(size)
    bar.close()
    shards = {s: w.close() for s, w in writers.items()}
    _check_splits(cfg, corpus, stats)
    source = {"specs": corpus.specs, "val_fraction": cfg.val_fraction, "stats": asdict(stats)}
    return stats, make_meta(tok, dtype, shards, source, split_bytes)


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


def make_meta(tok, dtype: str, shards: dict[str, list[ShardInfo]], source: dict,
              split_bytes: dict[str, int] | None = None) -> dict:
    """The contents of a dataset's meta.json (read back by `shards.TokenDataset`). `bytes`: each
    split's UTF-8 bytes of text, which with its token count turns a loss per token into bits
    per byte (datasets prepared before it lack it)."""
    meta = {
        "format_version": META_FORMAT_VERSION,
        "tokenizer": tok.kind,
        "vocab_size": tok.vocab_size,
        "eot_id": tok.eot_id,
        "dtype": dtype,
        "shards": {s: [asdict(i) for i in infos] for s, infos in shards.items()},
        "source": source,
        "created_by": f"ddpgpt {__version__}",
    }
    if split_bytes is not None:
        meta["bytes"] = dict(split_bytes)
    return meta


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
    check_out(out, cfg.force)
    tmp = out.with_name(f".{out.name}.partial-{os.getpid()}")
    corpus = resolve_sources(cfg.sources or ["stdlib"], exclude=[out.resolve(), tmp.resolve()])
    start = time.perf_counter()
    made: list[Path] = []
    stopped = (f"before prepare finished; removed the partial output {tmp} (--out {out} is "
               "unchanged); run the same command again to prepare it")
    with CleanExit(stopped) as signals:
        try:
            make_partial(out, tmp, made)
            stats, meta = _build(cfg, corpus, tmp)
            check_out(out, cfg.force)
            signals.hold()  # from here the dataset is published whatever comes: a signal
            publish(tmp, out)  # between its two renames would lose the old --out
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

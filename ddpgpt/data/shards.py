"""Token shard files and the dataset directory that lists them.

A shard is a fixed 1024-byte header followed by the tokens, little-endian:

    offset  size  field
    0       8     magic b"DDPGPTTK"
    8       4     format version (u32), currently 1
    12      4     dtype code (u32): 1 = uint16, 2 = uint32
    16      8     token count (u64)
    24      1000  zero padding

A dataset of conversations (data/chat.py) also holds a loss mask shard beside each token shard,
`train_NNNNNN.mask`: the same header with magic b"DDPGPTMK" and dtype code 3 (uint8), then one
byte per token of its token shard, 1 where that token is a target the loss counts. meta.json
lists them under "masks" and says format version 2 (version 1, no masks: every target counts;
a dataset without masks is written as version 1, so an older ddpgpt still reads it, and a
masked one is refused there rather than trained on with its masks ignored).

A dataset directory holds `meta.json` (written last, see `prepare/finish.py`), the shards
`train_NNNNNN.bin` / `val_NNNNNN.bin`, and `tokenizer.json` for the bpe tokenizer; it is a local
directory or a prefix of object storage (storage.py). Opening a dataset reads its meta.json and
its shards' headers, so it costs nothing however large it is; readers then read the spans they
need (stream.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ddpgpt.data import storage
from ddpgpt.errors import DataError, beside
from ddpgpt.files import sha256

MAGIC = b"DDPGPTTK"
MASK_MAGIC = b"DDPGPTMK"  # a loss mask shard's
FORMAT_VERSION = 1
HEADER_BYTES = 1024
META_FORMAT_VERSION = 2  # 2: loss masks ("masks"); written only by datasets that have them
_HEADER = struct.Struct("<8sIIQ")  # magic, version, dtype code, token count
DTYPE_CODES = {1: np.dtype(np.uint16), 2: np.dtype(np.uint32), 3: np.dtype(np.uint8)}
DTYPE_NAMES = {"uint16": 1, "uint32": 2, "uint8": 3}
REPREPARE = "re-run ddpgpt prepare"


def dtype_for_vocab(vocab_size: int) -> str:
    """The smallest token dtype name that holds ids below `vocab_size`."""
    return "uint16" if vocab_size <= 2**16 else "uint32"


@dataclass(frozen=True)
class ShardInfo:
    """One shard as `meta.json` records it."""

    file: str
    tokens: int
    sha256: str


class ShardWriter:
    """Streams token arrays into one shard file; `close()` writes the header and returns its info.

    The header is written last (the count is not known before), so a shard that was never closed
    fails validation with a size or magic error rather than passing as a short shard.
    """

    def __init__(self, path: str | os.PathLike, dtype: str, magic: bytes = MAGIC):
        self.path, self.magic = Path(path), magic
        self.dtype = np.dtype(dtype)
        self.count = 0
        self._f = open(self.path, "wb")
        self._f.write(bytes(HEADER_BYTES))

    @classmethod
    def reopen(cls, path: str | os.PathLike, dtype: str, count: int,
               magic: bytes = MAGIC) -> ShardWriter:
        """The writer of an unfinished shard, at its first `count` tokens (the rest dropped)."""
        self = cls.__new__(cls)
        self.path, self.dtype, self.count, self.magic = Path(path), np.dtype(dtype), count, magic
        self._f = open(self.path, "r+b")
        self._f.truncate(HEADER_BYTES + count * self.dtype.itemsize)
        self._f.seek(0, os.SEEK_END)
        return self

    def write(self, tokens: np.ndarray) -> None:
        with self._named():
            self._f.write(np.ascontiguousarray(tokens, dtype=self.dtype).tobytes())
        self.count += len(tokens)

    def sync(self) -> None:
        """Everything written so far is on the disk (before progress says it is)."""
        with self._named():
            self._f.flush()
            os.fsync(self._f.fileno())

    def close(self) -> ShardInfo:
        header = _HEADER.pack(self.magic, FORMAT_VERSION, DTYPE_NAMES[self.dtype.name], self.count)
        with self._named():
            self._f.seek(0)
            self._f.write(header)
            self._f.flush()
            os.fsync(self._f.fileno())
            self._f.close()
        return ShardInfo(self.path.name, self.count, sha256(self.path))

    @contextlib.contextmanager
    def _named(self):
        """A failed write (a full disk) names this shard: the OS's error names no file."""
        try:
            yield
        except OSError as e:
            e.filename = e.filename or str(self.path)
            raise


def read_header(path: Path, magic: bytes = MAGIC) -> tuple[np.dtype, int]:
    """Validates a shard's header and size; returns (dtype, token count)."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(_HEADER.size)
    except OSError as e:
        raise DataError(f"{path}: cannot read shard ({e.strerror}); {REPREPARE}") from None
    return parse_header(raw, size, path, magic)


def parse_header(raw: bytes, size: int, path, magic: bytes = MAGIC) -> tuple[np.dtype, int]:
    """(dtype, token count) of a shard of `size` bytes whose first bytes are `raw`, validated;
    `path` names it in the one line of a DataError. `magic`: a token shard's, or a mask's."""
    if len(raw) < _HEADER.size:
        raise DataError(f"{path}: truncated shard ({size} bytes, shorter than its header); "
                        f"{REPREPARE}")
    found, version, code, count = _HEADER.unpack(raw[:_HEADER.size])
    if found != magic:
        what = "shard" if magic == MAGIC else "mask shard"
        raise DataError(f"{path}: not a ddpgpt {what} (bad magic {found!r}); {REPREPARE}")
    if version > FORMAT_VERSION:
        raise DataError(
            f"{path}: shard format version {version} is newer than this ddpgpt reads "
            f"({FORMAT_VERSION}); upgrade ddpgpt or {REPREPARE}"
        )
    if code not in DTYPE_CODES:
        raise DataError(f"{path}: unknown token dtype code {code} in header; {REPREPARE}")
    dtype = DTYPE_CODES[code]
    expected = HEADER_BYTES + count * dtype.itemsize
    if size != expected:
        what = "truncated" if size < expected else "has trailing bytes"
        raise DataError(
            f"{path}: {what}: header says {count} {dtype.name} tokens ({expected} bytes) "
            f"but the file has {size} bytes; {REPREPARE}"
        )
    return dtype, count


def open_shard(path: Path, magic: bytes = MAGIC) -> np.ndarray:
    """A read-only memory map of a validated shard's tokens, shape (count,)."""
    dtype, count = read_header(path, magic)
    if count == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", offset=HEADER_BYTES, shape=(count,))


@dataclass(frozen=True)
class Shard:
    """One shard as a reader sees it: its file's name in the dataset, its token dtype and
    count (its tokens start at byte HEADER_BYTES)."""

    file: str
    dtype: np.dtype
    count: int

    def __len__(self) -> int:
        return self.count


class TokenDataset:
    """A prepared dataset, a local directory or a prefix of object storage (data/storage.py),
    checked against its `meta.json` when opened.

    Opening validates every shard's header and size and that they agree with `meta.json`
    (file present, token count, dtype); `verify()` also re-hashes every shard. A dataset in
    object storage is listed once and its shards' headers read with one ranged read each; no
    token is read."""

    def __init__(self, path: str | os.PathLike):
        self.files = storage.open_dir(path)
        self.remote = self.files.remote
        self.path = str(self.files) if self.remote else Path(path)
        meta_where = self.files.where("meta.json")
        if not self.files.has("meta.json"):
            if not self.files.exists():
                near = self.files.beside() if self.remote else \
                    beside(self.path, "meta.json", "prepared")
                raise DataError(f"dataset {self.path} does not exist{near}; create it with: "
                                f"ddpgpt prepare --out {self.path}")
            raise DataError(f"dataset {self.path} has no meta.json (not prepared, or prepare did "
                            f"not finish); {REPREPARE} --out {self.path}")
        try:
            self.meta_bytes = self.files.read("meta.json")
        except OSError as e:
            raise DataError(f"{meta_where}: cannot read it ({e.strerror}); {REPREPARE}") from None
        try:
            self.meta = json.loads(self.meta_bytes)
            self.vocab_size = int(self.meta["vocab_size"])
            self.eot_id = int(self.meta["eot_id"])
            self.dtype = np.dtype(self.meta["dtype"])
            self.tokenizer = str(self.meta["tokenizer"])
            version = int(self.meta["format_version"])
            listed = {split: [ShardInfo(**s) for s in self.meta["shards"][split]]
                      for split in ("train", "val")}
            masks = {split: [ShardInfo(**s) for s in self.meta["masks"][split]]
                     for split in ("train", "val")} if "masks" in self.meta else None
        except (ValueError, KeyError, TypeError) as e:
            raise DataError(f"{meta_where}: corrupt or incomplete meta.json "
                            f"({type(e).__name__}: {e}); {REPREPARE}") from None
        if version > META_FORMAT_VERSION:
            raise DataError(
                f"{meta_where}: dataset format version {version} is newer than this ddpgpt reads "
                f"({META_FORMAT_VERSION}); upgrade ddpgpt or {REPREPARE}"
            )
        self.shards = listed
        self.masks = masks  # each token shard's loss mask (conversations); None: all ones
        self.masked = masks is not None
        self.split_bytes: dict | None = self.meta.get("bytes")  # absent before bits per byte
        self._shards = self._open(listed, MAGIC, self.dtype)
        self._masks = self._open(masks, MASK_MAGIC, np.dtype(np.uint8)) if masks else None
        for split in ("train", "val") if masks else ():
            if [len(s) for s in self._masks[split]] != [len(s) for s in self._shards[split]]:
                raise DataError(f"{meta_where}: the {split} split's mask shards do not match its "
                                f"token shards one for one; {REPREPARE}")

    def _open(self, listed: dict[str, list[ShardInfo]], magic: bytes,
              dtype: np.dtype) -> dict[str, list[Shard]]:
        """The splits' shards listed, each header and size validated against meta.json."""
        infos = [info for split in ("train", "val") for info in listed[split]]
        headers = self._headers(infos, magic)
        opened = iter([self._check(info, *header, dtype) for info, header in zip(infos, headers)])
        return {split: [next(opened) for _ in listed[split]] for split in ("train", "val")}

    def _headers(self, infos: list[ShardInfo], magic: bytes) -> list[tuple[np.dtype, int]]:
        """Each shard's (dtype, count), its header and size validated."""
        for info in infos:
            if not self.files.has(info.file):
                raise DataError(f"{self.files.where('meta.json')} lists {info.file} but the file "
                                f"is missing; {REPREPARE}")
        if not self.remote:
            return [read_header(self.path / info.file, magic) for info in infos]
        raws = self.files.ranges([(i.file, 0, min(_HEADER.size, self.files.size(i.file)))
                                  for i in infos])
        return [parse_header(raw, self.files.size(i.file), self.files.where(i.file), magic)
                for i, raw in zip(infos, raws)]

    def _check(self, info: ShardInfo, dtype: np.dtype, count: int, expected: np.dtype) -> Shard:
        where = self.files.where(info.file)
        if dtype != expected:
            raise DataError(f"{where}: header dtype {dtype.name} but meta.json says "
                            f"{expected.name}; {REPREPARE}")
        if count != info.tokens:
            raise DataError(f"{where}: holds {count} tokens but meta.json says "
                            f"{info.tokens}; {REPREPARE}")
        return Shard(info.file, dtype, count)

    @property
    def fingerprint(self) -> str:
        """sha256 of meta.json, which itself holds every shard's sha256: names the exact data."""
        return hashlib.sha256(self.meta_bytes).hexdigest()

    @property
    def tokenizer_fingerprint(self) -> str:
        """The tokenizer's own identity (see tokenizer.fingerprint), not the data's."""
        from ddpgpt.data.tokenizer import fingerprint
        return fingerprint(self.tokenizer, self.path)

    def shard_files(self, split: str, masks: bool = False) -> list[Shard]:
        """The split's shards in order; together they are one token stream (stream.py).
        `masks`: its mask shards instead (a dataset of conversations)."""
        return (self._masks if masks else self._shards)[split]

    def infos(self) -> list[ShardInfo]:
        """Every file meta.json lists with its sha256: the token shards, then the masks."""
        return [i for listed in (self.shards, self.masks or {}) for infos in listed.values()
                for i in infos]

    def tokens(self, split: str, masks: bool = False) -> list[np.ndarray]:
        """The split's shards' tokens (`masks`: their loss masks), in order: memory maps of a
        local dataset; a remote dataset's read whole (for tests and small data: a training
        reads windows)."""
        out = []
        for shard in self.shard_files(split, masks):
            if not self.remote:
                out.append(open_shard(self.path / shard.file, MASK_MAGIC if masks else MAGIC))
                continue
            raw = self.files.read(shard.file)
            out.append(np.frombuffer(raw, dtype=shard.dtype, offset=HEADER_BYTES,
                                     count=shard.count))
        return out

    def num_tokens(self, split: str) -> int:
        return sum(info.tokens for info in self.shards[split])

    def bits_per_byte(self, loss: float, split: str = "val") -> float | None:
        """A mean loss per token (nats) as bits per byte of the split's text: the bits to encode
        the split at that loss over its UTF-8 bytes, which compares across tokenizers. Exact for
        a loss over the whole split; for a sample of its windows it assumes the split's average
        bytes per token. None for a dataset whose meta.json has no byte counts, and for one of
        conversations (its loss is over the assistant's tokens alone, its bytes are all the
        text's)."""
        if self.masked:
            return None
        try:
            n_bytes = int(self.split_bytes[split])
        except (TypeError, KeyError, ValueError):
            return None
        if n_bytes <= 0:
            return None
        return loss / math.log(2) * self.num_tokens(split) / n_bytes

    def bytes_advice(self) -> str:
        """One line for a dataset without byte counts: why they are missing, what that costs
        (bits per byte; never the loss), and how to get them where that is possible. Prepared
        from tokens (llm.c shards: meta.json's source.split names the files, not our split of
        documents), the text was never seen, and preparing again cannot count it."""
        split = self.meta.get("source", {}).get("split")
        if split not in (None, "documents", "tokens"):
            return (f"dataset {self.path} was prepared from tokens ({split}) whose text ddpgpt "
                    "never saw: bits per byte need the text's size in bytes, so val_bpb is not "
                    "reported (val_loss is unaffected)")
        return (f"dataset {self.path} has no byte counts in meta.json (prepared by an older "
                "ddpgpt), so val_bpb is not reported (val_loss is unaffected); prepare it again "
                f"(ddpgpt prepare ... --out {self.path} --force) to get them")

    def verify(self, part: int = 0, parts: int = 1) -> int:
        """Re-hashes shards against meta.json (every `parts`-th from `part`, so that W ranks can
        share the work); returns the number of shards checked."""
        mine = self.infos()[part::parts]
        for info in mine:
            actual = self.files.sha256(info.file)
            if actual != info.sha256:
                raise DataError(
                    f"{self.files.where(info.file)}: sha256 mismatch (file {actual[:16]}, "
                    f"meta.json {info.sha256[:16]}): the shard changed after prepare; {REPREPARE}"
                )
        return len(mine)

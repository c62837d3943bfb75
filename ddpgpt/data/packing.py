"""Rows that start at document starts (data.align = bos): documents packed best-fit into rows of
T+1 tokens, what does not fit carried into the next row rather than cropped.

A prepared dataset places the end-of-text token before every document (prepare.py), so a
document is the stretch from one end-of-text token to the next, and its first token marks where
it starts (the model's document mask reads the same token: model/attention.py).

Packing (`pack`), over the split's documents in file order, with a pool of the next LOOKAHEAD
documents sorted by length. Each row of T+1 tokens:

1. begins with the continuation carried from the row before, if any (as much of it as fits);
2. then takes, while room is left, the longest pooled document that fits whole (best fit);
3. when none fits, takes the head of the longest pooled document to fill the row, and carries
   its rest into the next row, where it comes first (a document longer than a row is so split
   across rows: each of its pieces starts a row).

So every row begins at a document's start or at the continuation of the document the row before
ended with; inside a row every boundary is an end-of-text token, which is what the next-token
target there is (as in the stream). No token is cropped: only the last row of the split, if not
full, is dropped (fewer than T+1 tokens). What a document loses is context: a continuation does
not see the start of its document (docs/performance.md measures the share of such tokens).

Conversations (a dataset with loss masks, data/chat.py) are packed whole: where no pooled
conversation fits the room left, the row is padded to its end (end-of-text tokens whose mask is
0: they are attended to as documents of their own and never trained on) rather than filled
with the head of one; only a conversation longer than a whole row is split (step 3, from a row's
start), with its mask, and the split ones are counted (`conversations_note`). The last, partial
row is padded, not dropped.

The packing depends only on the split's tokens and T; the epoch's order of the rows is the
loader's (order.py), seeded by (seed, epoch). So the rows of step k depend only on (data, seed,
T, G, k), at any W, and the loader's state is the same cursor as the stream's.

Memory: three int64 arrays (each piece's start and length, each row's first piece), about
(documents + rows) · 16 bytes, built once per (split, T) and kept beside the shards as
`packing-SPLIT-{T+1}.npz` (keyed by the dataset's fingerprint and its shards' identities,
storage's `identity`, so a shard rewritten in place is packed again; written atomically, or as
one object in object storage). What packing reads: the whole split's tokens once (doc_starts,
in SCAN_BLOCK reads), then nothing while a cache of it is found. A local dataset that cannot be
written is packed again at each start, by every rank. A dataset at a URL is also kept on each
machine (storage.kept_here: DDPGPT_CACHE_DIR/packing/...), and the node's ranks take turns on a
lock there: the first packs and writes both copies, the others read one. So a URL's split is
read once per node at its first start (nodes starting together may each read it once; a later
node reads the URL's copy, if the dataset could be written), and never again on that node. No
Python object per
document is held: the scan for document starts reads the shards in blocks, and the pool holds
LOOKAHEAD documents.
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import os
import zipfile
from array import array
from bisect import bisect_right, insort
from pathlib import Path

import numpy as np

from ddpgpt.data import storage
from ddpgpt.data.shards import TokenDataset
from ddpgpt.data.stream import TokenStream
from ddpgpt.errors import UserError
from ddpgpt.files import atomic_write

VERSION = 2  # of the packing: a cache file of another version is packed again (2: documents)
LOOKAHEAD = 1000  # documents the best fit chooses among (nanochat's buffer)
ALIGNS = ("stream", "bos")
SCAN_BLOCK = 1 << 22  # tokens read at a time when scanning for document starts


def doc_starts(stream: TokenStream, eot_id: int) -> np.ndarray:
    """Positions of the split's document starts (its end-of-text tokens; 0 too if the stream
    does not begin with one), int64, read in blocks of SCAN_BLOCK tokens."""
    parts = [np.zeros(1, dtype=np.int64)]
    dtype = stream.dtype
    for pos in range(0, stream.num_tokens, SCAN_BLOCK):
        block = np.empty(min(SCAN_BLOCK, stream.num_tokens - pos), dtype=dtype)
        stream.read_span(pos, block)
        parts.append(np.flatnonzero(block == eot_id).astype(np.int64) + pos)
    starts = np.concatenate(parts)
    return starts[1:] if len(starts) > 1 and starts[1] == 0 else starts


def pack(starts: np.ndarray, num_tokens: int, span: int, lookahead: int = LOOKAHEAD,
         whole: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The packing of the module docstring for documents beginning at `starts` in a stream of
    num_tokens. Returns (piece_start, piece_len, row_ptr): row i is the pieces
    row_ptr[i]..row_ptr[i+1]-1, each tokens piece_start..piece_start+piece_len-1 of the stream
    (piece_start -1: padding), summing to `span`. `whole`: conversations' packing (a document
    shorter than a row is never split: the row is padded instead)."""
    ends = np.append(starts[1:], num_tokens)
    piece_start, piece_len, row_ptr = array("q"), array("q"), array("q", [0])
    pool: list[tuple[int, int]] = []  # (length, document) of the waiting documents, sorted
    ahead, carry = 0, None  # the next document to pool; (start, length) to begin the next row
    while True:
        room = span
        if carry is not None:
            start, length = carry
            take = min(length, room)
            piece_start.append(start)
            piece_len.append(take)
            room -= take
            carry = (start + take, length - take) if length > take else None
        while room:
            while ahead < len(starts) and len(pool) < lookahead:
                insort(pool, (int(ends[ahead] - starts[ahead]), ahead))
                ahead += 1
            if not pool:
                break
            i = bisect_right(pool, (room, len(starts))) - 1  # the longest that fits whole
            if i < 0 and whole and room < span:  # none fits: the rest of the row is padding
                piece_start.append(-1)
                piece_len.append(room)
                room = 0
                break
            length, doc = pool.pop(i if i >= 0 else -1)
            take = min(length, room)
            piece_start.append(int(starts[doc]))
            piece_len.append(take)
            if take < length:  # none fits: the longest fills the row and goes on in the next
                carry = (int(starts[doc]) + take, length - take)
            room -= take
        if room and whole and room < span:  # the data ran out: conversations' is padded
            piece_start.append(-1)
            piece_len.append(room)
            room = 0
        if room:  # the data ran out: the last, partial row is dropped
            del piece_start[row_ptr[-1]:], piece_len[row_ptr[-1]:]
            break
        row_ptr.append(len(piece_start))
    return tuple(np.frombuffer(a, dtype=np.int64).copy() for a in (piece_start, piece_len,
                                                                      row_ptr))


class PackedRows:
    """A split's packed rows, with TokenStream's interface: `num_windows` rows of T+1 tokens,
    `read(rows, out)`. See the module docstring."""

    def __init__(self, dataset: TokenDataset, split: str, seq_len: int, cache: str = ""):
        self.stream = TokenStream(dataset, split, seq_len, cache)
        self.dataset_path, self.split, self.seq_len = dataset.path, split, seq_len
        self.num_tokens, self.eot_id = self.stream.num_tokens, dataset.eot_id
        self.masked = self.stream.masked  # conversations: packed whole, padded (pack)
        (self.piece_start, self.piece_len, self.row_ptr, self.documents,
         self.long) = _index(dataset, self.stream)
        self.num_windows = len(self.row_ptr) - 1

    def read(self, rows: np.ndarray, out: np.ndarray, mask: np.ndarray | None = None) -> None:
        """Copies rows into `out`, shape (len(rows), T+1), converting to out's dtype; `mask`
        (the same shape): their loss masks (all ones for a dataset without; 0 on padding)."""
        buf = np.empty((len(rows), self.seq_len + 1), dtype=self.stream.dtype)
        for i, r in enumerate(rows):
            filled = 0
            for p in range(self.row_ptr[r], self.row_ptr[r + 1]):
                n, start = int(self.piece_len[p]), int(self.piece_start[p])
                piece = slice(filled, filled + n)
                if start < 0:  # padding: documents of one end-of-text token, never targets
                    buf[i, piece] = self.eot_id
                else:
                    self.stream.read_span(start, buf[i, piece])
                if mask is not None and start >= 0 and self.masked:
                    self.stream.masks.read_span(start, mask[i, piece])
                elif mask is not None:
                    mask[i, piece] = start >= 0
                filled += n
        out[:len(buf)] = buf

    @property
    def arrival_s(self) -> float:
        return self.stream.arrival_s

    def prefetch(self, rows: np.ndarray) -> None:
        """The rows read next (TokenStream.prefetch): their pieces' spans."""
        self.stream.prefetch_spans([(int(self.piece_start[p]), int(self.piece_len[p]))
                                    for r in rows for p in range(self.row_ptr[r],
                                                                 self.row_ptr[r + 1])
                                    if self.piece_start[p] >= 0])

    def stats(self) -> dict:
        """What the packing kept and lost: tokens in rows, tokens dropped (the last partial row),
        and tokens in continuations (pieces that do not begin at their document's start), with
        the number of documents split."""
        starts = doc_starts(self.stream, self.eot_id)
        real = self.piece_start >= 0
        continued = real & ~np.isin(self.piece_start, starts)
        return {"tokens": self.num_tokens, "rows": self.num_windows,
                "in_rows": int(self.piece_len[real].sum()),
                "dropped": self.num_tokens - int(self.piece_len[real].sum()),
                "padding": int(self.piece_len[~real].sum()),
                "continued": int(self.piece_len[continued].sum()),
                "docs": len(starts), "docs_split": len(np.unique(
                    np.searchsorted(starts, self.piece_start[continued], side="right")))}


def one_document(rows: TokenStream | PackedRows) -> str | None:
    """The warning for packed rows of a split that holds one document (no end-of-text token, or
    only the first): rows then start at no document, every row is a slice of it, and the
    document mask masks nothing. None for more documents, or for the stream."""
    if not isinstance(rows, PackedRows) or rows.documents > 1:
        return None
    return (f"data.align bos: the {rows.split} split of dataset {rows.dataset_path} is one "
            f"document (no end-of-text token, id {rows.eot_id}, between its tokens), so every "
            "row is a slice of it and model.doc_mask masks nothing; prepare the data with its "
            "documents apart (ddpgpt prepare puts an end-of-text token before each), or use "
            "--data.align stream")


def conversations_note(rows: TokenStream | PackedRows) -> str | None:
    """For rows packed from conversations: how many are longer than a row, so split across
    rows with their masks (their later rows do not see their start), and how much of the rows
    is padding; None for other rows."""
    if not isinstance(rows, PackedRows) or not rows.masked:
        return None
    pad = int(rows.piece_len[rows.piece_start < 0].sum())
    share = pad / max(1, rows.num_windows * (rows.seq_len + 1))
    split = (f"{rows.long:,} of {rows.documents:,} conversations are longer than a row of "
             f"{rows.seq_len + 1} tokens, each split across rows with its mask (their later rows "
             "do not see their start)" if rows.long else f"each of its {rows.documents:,} "
             f"conversations fits a row of {rows.seq_len + 1} tokens whole")
    return (f"the {rows.split} split of {rows.dataset_path}: {split}; padding is {share:.1%} "
            f"of the rows' {rows.num_windows:,} × {rows.seq_len + 1} tokens")


def row_source(dataset: TokenDataset, split: str, seq_len: int,
               align: str = "stream", cache: str = "") -> TokenStream | PackedRows:
    """The rows a loader reads from a split (data.align): windows of the stream, or packed rows
    that start at document starts. `cache`: data.cache, for a remote dataset's reads."""
    if align not in ALIGNS:
        raise ValueError(f"data.align {align!r} is not one of {ALIGNS}")
    return PackedRows(dataset, split, seq_len, cache) if align == "bos" else \
        TokenStream(dataset, split, seq_len, cache)


def _index(dataset: TokenDataset, stream: TokenStream) -> tuple[np.ndarray, ...]:
    """The packing of `stream` and its number of documents, from its cache file beside the
    shards (a local directory's or an object's) if that is of this data, its shards' identities,
    version and T; for a dataset at a URL, else from this machine's copy (storage.kept_here),
    made by the first of the node's ranks to get here while the others wait for it."""
    span = stream.seq_len + 1
    name = f"packing-{stream.split}-{span}.npz"
    files = [dataset.files.identity(info.file) for info in dataset.shards[stream.split]]
    key = f"{VERSION} {dataset.fingerprint} {span} {files}" + (" whole" if stream.masked else "")
    if dataset.files.has(name) and (found := _load(lambda: dataset.files.read(name), key)):
        return found
    if not dataset.files.remote:
        return _build(dataset, stream, key, name)
    here = storage.kept_here("packing", dataset.files, name)
    with _node_lock(here):  # one rank per node reads the split; the others then read its copy
        if here.is_file() and (found := _load(here.read_bytes, key)):
            return found
        return _build(dataset, stream, key, name, here)


def _load(read, key: str) -> tuple[np.ndarray, ...] | None:
    with contextlib.suppress(OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile,
                             UserError):
        with np.load(io.BytesIO(read())) as saved:
            if str(saved["key"]) == key:
                return (saved["piece_start"], saved["piece_len"], saved["row_ptr"],
                        int(saved["documents"]), int(saved["long"]) if "long" in saved else 0)
    return None


def _build(dataset: TokenDataset, stream: TokenStream, key: str, name: str,
           here: Path | None = None) -> tuple[np.ndarray, ...]:
    """The packing made (the whole split read once), kept beside the shards when they can be
    written, and in `here` (this machine's copy of a URL's)."""
    starts = doc_starts(stream, dataset.eot_id)
    span = stream.seq_len + 1
    arrays = pack(starts, stream.num_tokens, span, whole=stream.masked)
    long = int(np.count_nonzero(np.diff(np.append(starts, stream.num_tokens)) > span))
    data = io.BytesIO()
    np.savez(data, key=np.array(key), piece_start=arrays[0], piece_len=arrays[1],
             row_ptr=arrays[2], documents=np.array(len(starts)), long=np.array(long))
    with contextlib.suppress(OSError, UserError):  # a read-only dataset: packed again next time
        dataset.files.write(name, data.getvalue())
    if here is not None:
        with contextlib.suppress(OSError):  # no cache here: packed again next time
            with atomic_write(here) as f:
                f.write(data.getvalue())
    return (*arrays, len(starts), long)


@contextlib.contextmanager
def _node_lock(here: Path):
    """An exclusive flock on HERE.lock, held while this process reads or makes the packing (the
    node's other ranks wait here, as long as one pack of the split takes: it ends, or that
    process dies and its lock with it); none where the cache cannot be made."""
    try:
        here.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(here.with_name(here.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)

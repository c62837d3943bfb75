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

The packing depends only on the split's tokens and T; the epoch's order of the rows is the
loader's (order.py), seeded by (seed, epoch). So the rows of step k depend only on (data, seed,
T, G, k), at any W, and the loader's state is the same cursor as the stream's.

Memory: three int64 arrays (each piece's start and length, each row's first piece), about
(documents + rows) · 16 bytes, built once per (split, T) and kept beside the shards as
`packing-SPLIT-{T+1}.npz` (keyed by the dataset's fingerprint; written atomically, or as one
object in object storage; a dataset that cannot be written is packed again at each start: for
a dataset in object storage that reads the whole split once per rank, so give the first start
write access, or prepare the packing once with a start that has it). No Python object per document
is held: the scan for document starts reads the shards in blocks, and the pool holds LOOKAHEAD
documents.
"""

from __future__ import annotations

import contextlib
import io
import zipfile
from array import array
from bisect import bisect_right, insort

import numpy as np

from ddpgpt.data.shards import TokenDataset
from ddpgpt.data.stream import TokenStream
from ddpgpt.errors import UserError

VERSION = 1  # of the packing: a cache file of another version is packed again
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


def pack(starts: np.ndarray, num_tokens: int, span: int,
         lookahead: int = LOOKAHEAD) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The packing of the module docstring for documents beginning at `starts` in a stream of
    num_tokens. Returns (piece_start, piece_len, row_ptr): row i is the pieces
    row_ptr[i]..row_ptr[i+1]-1, each tokens piece_start..piece_start+piece_len-1 of the stream,
    summing to `span`."""
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
            length, doc = pool.pop(i if i >= 0 else -1)
            take = min(length, room)
            piece_start.append(int(starts[doc]))
            piece_len.append(take)
            if take < length:  # none fits: the longest fills the row and goes on in the next
                carry = (int(starts[doc]) + take, length - take)
            room -= take
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
        self.piece_start, self.piece_len, self.row_ptr = _index(dataset, self.stream)
        self.num_windows = len(self.row_ptr) - 1

    def read(self, rows: np.ndarray, out: np.ndarray) -> None:
        """Copies rows into `out`, shape (len(rows), T+1), converting to out's dtype."""
        buf = np.empty((len(rows), self.seq_len + 1), dtype=self.stream.dtype)
        for row, r in zip(buf, rows):
            filled = 0
            for p in range(self.row_ptr[r], self.row_ptr[r + 1]):
                n = int(self.piece_len[p])
                self.stream.read_span(int(self.piece_start[p]), row[filled:filled + n])
                filled += n
        out[:len(buf)] = buf

    def prefetch(self, rows: np.ndarray) -> None:
        """The rows read next (TokenStream.prefetch): their pieces' spans."""
        self.stream.prefetch_spans([(int(self.piece_start[p]), int(self.piece_len[p]))
                                    for r in rows for p in range(self.row_ptr[r],
                                                                 self.row_ptr[r + 1])])

    def stats(self) -> dict:
        """What the packing kept and lost: tokens in rows, tokens dropped (the last partial row),
        and tokens in continuations (pieces that do not begin at their document's start), with
        the number of documents split."""
        starts = doc_starts(self.stream, self.eot_id)
        continued = ~np.isin(self.piece_start, starts)
        return {"tokens": self.num_tokens, "rows": self.num_windows,
                "in_rows": int(self.piece_len.sum()),
                "dropped": self.num_tokens - int(self.piece_len.sum()),
                "continued": int(self.piece_len[continued].sum()),
                "docs": len(starts), "docs_split": len(np.unique(
                    np.searchsorted(starts, self.piece_start[continued], side="right")))}


def row_source(dataset: TokenDataset, split: str, seq_len: int,
               align: str = "stream", cache: str = "") -> TokenStream | PackedRows:
    """The rows a loader reads from a split (data.align): windows of the stream, or packed rows
    that start at document starts. `cache`: data.cache, for a remote dataset's reads."""
    if align not in ALIGNS:
        raise ValueError(f"data.align {align!r} is not one of {ALIGNS}")
    return PackedRows(dataset, split, seq_len, cache) if align == "bos" else \
        TokenStream(dataset, split, seq_len, cache)


def _index(dataset: TokenDataset, stream: TokenStream) -> tuple[np.ndarray, ...]:
    """The packing of `stream`, from its cache file beside the shards (a local directory's or
    an object's) if that is of this data, version and T."""
    span = stream.seq_len + 1
    name = f"packing-{stream.split}-{span}.npz"
    key = f"{VERSION} {dataset.fingerprint} {span}"
    with contextlib.suppress(OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile,
                             UserError):
        if dataset.files.has(name):
            with np.load(io.BytesIO(dataset.files.read(name))) as saved:
                if str(saved["key"]) == key:
                    return saved["piece_start"], saved["piece_len"], saved["row_ptr"]
    arrays = pack(doc_starts(stream, dataset.eot_id), stream.num_tokens, span)
    data = io.BytesIO()
    np.savez(data, key=np.array(key), piece_start=arrays[0], piece_len=arrays[1],
             row_ptr=arrays[2])
    with contextlib.suppress(OSError, UserError):  # a read-only dataset: packed again next time
        dataset.files.write(name, data.getvalue())
    return arrays

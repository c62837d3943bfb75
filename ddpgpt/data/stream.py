"""A split's shards as one token stream, read span by span: the loader's windows (loader.py)
and the packed rows' pieces (packing.py) are spans of it. A dataset of conversations has a
second stream beside it, its loss masks (shards.py), read at the same positions."""

from __future__ import annotations

from bisect import bisect_right

import numpy as np

from ddpgpt.data.shards import HEADER_BYTES, REPREPARE, TokenDataset
from ddpgpt.errors import DataError


class TokenStream:
    """A split's shards as one indexable token stream, cut into windows of T+1 tokens.

    A window is read from its shard's file with pread(2) (a local dataset) or a ranged GET (one
    in object storage: data/storage.py), never a whole shard: the rank then holds the bytes it
    asked for and nothing else. (A memory map would also leave resident, and counted in the
    rank's memory, every page-cache page around each window that the kernel maps with it, ~0.75
    MB per window on the 2-core VM with large page-cache folios: memory that grows with the span
    of data a run samples; docs/performance.md, "A start at any size".) `prefetch` names the
    spans read next, so that a remote dataset's reader fetches them while the step computes."""

    def __init__(self, dataset: TokenDataset, split: str, seq_len: int, cache: str = "",
                 masks: bool = False):
        """`masks`: the stream of the split's loss masks (a dataset of conversations)."""
        self.dataset_path, self.split = dataset.path, split
        self.shards = [s for s in dataset.shard_files(split, masks) if len(s)]
        self.starts = np.cumsum([0] + [len(s) for s in self.shards])  # token offset of each shard
        self.num_tokens = int(self.starts[-1])
        self.seq_len = seq_len
        self.num_windows = max(0, (self.num_tokens - 1) // seq_len)
        self.dtype = self.shards[0].dtype if self.shards else np.dtype(np.uint16)
        self.where = dataset.files.where
        self.reader = dataset.files.reader(cache)
        self.masks = TokenStream(dataset, split, seq_len, cache, True) \
            if dataset.masked and not masks else None
        self.masked = self.masks is not None

    def read(self, windows: np.ndarray, out: np.ndarray, mask: np.ndarray | None = None) -> None:
        """Copies windows into `out`, shape (len(windows), T+1), converting to out's dtype;
        `mask` (the same shape): their loss masks (all ones for a dataset without)."""
        span = self.seq_len + 1
        buf = np.empty((len(windows), span), dtype=self.dtype)  # (rows, T+1), read into directly
        for row, w in zip(buf, windows):
            self.read_span(int(w) * self.seq_len, row)
        out[:len(buf)] = buf
        if mask is not None:
            if self.masks is None:
                mask[:len(buf)] = 1
            else:
                self.masks.read(windows, mask)

    @property
    def arrival_s(self) -> float:
        """How long a fetch ahead takes to arrive (fetch.RemoteReader; 0 for a local disk)."""
        return max(self.reader.arrival_s, self.masks.arrival_s if self.masks else 0.0)

    def prefetch(self, windows: np.ndarray) -> None:
        """The windows read next: a remote reader fetches them in the background."""
        self.prefetch_spans([(int(w) * self.seq_len, self.seq_len + 1) for w in windows])

    def prefetch_spans(self, spans: list[tuple[int, int]]) -> None:
        """(position, tokens) spans of the stream read next (and of its masks)."""
        self.reader.prefetch([self._request(k, local, n) for pos, length in spans
                              for k, local, n in self.pieces(pos, length)])
        if self.masks is not None:
            self.masks.prefetch_spans(spans)

    def pieces(self, pos: int, length: int) -> list[tuple[int, int, int]]:
        """Tokens pos..pos+length of the stream as (shard, its first token, tokens) pieces: a
        span crosses a shard boundary at most a few times."""
        out, filled = [], 0
        k = bisect_right(self.starts, pos) - 1
        while filled < length:
            local = pos + filled - int(self.starts[k])
            n = min(length - filled, len(self.shards[k]) - local)
            out.append((k, local, n))
            filled += n
            k += 1
        return out

    def read_span(self, pos: int, into: np.ndarray) -> None:
        """Tokens pos.. of the stream into `into` (a contiguous array in the shards' dtype)."""
        filled = 0
        for k, local, n in self.pieces(pos, len(into)):
            self._pread(k, local, into[filled:filled + n])
            filled += n

    def _request(self, k: int, start: int, n: int) -> tuple[str, int, int]:
        return (self.shards[k].file, HEADER_BYTES + start * self.dtype.itemsize,
                n * self.dtype.itemsize)

    def _pread(self, k: int, start: int, into: np.ndarray) -> None:
        """Tokens start.. of shard k into `into` (a contiguous row: filled in place)."""
        name, offset, _ = self._request(k, start, len(into))
        got = self.reader.read(name, offset, into)
        if got != into.nbytes:  # checked when the dataset opened: cut since
            raise DataError(f"{self.where(name)}: shorter than its header says (read {got} of "
                            f"{into.nbytes} bytes at token {start}); {REPREPARE}")

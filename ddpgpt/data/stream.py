"""A split's shards as one token stream, read with pread(2): the loader's windows (loader.py)
and the packed rows' pieces (packing.py) are spans of it."""

from __future__ import annotations

import contextlib
import os
from bisect import bisect_right

import numpy as np

from ddpgpt.data.shards import REPREPARE, TokenDataset
from ddpgpt.errors import DataError

OPEN_FILES = 256  # shard files a stream keeps open at most (2e10 tokens: 200 shards)


class TokenStream:
    """A split's shards as one indexable token stream, cut into windows of T+1 tokens.

    A window is read with pread(2) from its shard's file, not sliced out of the memory map: the
    rank then holds the bytes it asked for and nothing else. A map would also leave resident, and
    counted in the rank's memory, every page-cache page around each window that the kernel maps
    with it (with large page-cache folios, ~0.75 MB per window on the 2-core VM): memory that grows
    with the span of data a run samples (docs/performance.md, "A start at any size")."""

    def __init__(self, dataset: TokenDataset, split: str, seq_len: int):
        self.dataset_path, self.split = dataset.path, split
        self.shards = [s for s in dataset.tokens(split) if len(s)]  # memory maps: lengths, files
        self.starts = np.cumsum([0] + [len(s) for s in self.shards])  # token offset of each shard
        self.num_tokens = int(self.starts[-1])
        self.seq_len = seq_len
        self.num_windows = max(0, (self.num_tokens - 1) // seq_len)
        self._files: dict[int, int] = {}  # shard -> open descriptor, the most recent last

    def read(self, windows: np.ndarray, out: np.ndarray) -> None:
        """Copies windows into `out`, shape (len(windows), T+1), converting to out's dtype."""
        span = self.seq_len + 1
        buf = np.empty((len(windows), span), dtype=self.shards[0].dtype if self.shards else
                       np.uint16)  # (rows, T+1) in the shards' dtype, read into directly
        for row, w in zip(buf, windows):
            self.read_span(int(w) * self.seq_len, row)
        out[:len(buf)] = buf

    def read_span(self, pos: int, into: np.ndarray) -> None:
        """Tokens pos.. of the stream into `into` (a contiguous array in the shards' dtype)."""
        filled, span = 0, len(into)
        k = bisect_right(self.starts, pos) - 1
        while filled < span:  # a span crosses a shard boundary at most a few times
            local = pos + filled - int(self.starts[k])
            n = min(span - filled, len(self.shards[k]) - local)
            self._pread(k, local, into[filled:filled + n])
            filled += n
            k += 1

    def _pread(self, k: int, start: int, into: np.ndarray) -> None:
        """Tokens start.. of shard k into `into` (a contiguous row: filled in place)."""
        shard = self.shards[k]
        got = os.preadv(self._fd(k), [into], shard.offset + start * shard.dtype.itemsize)
        if got != into.nbytes:  # checked when the dataset opened: cut since
            raise DataError(f"{shard.filename}: shorter than its header says (read {got} of "
                            f"{into.nbytes} bytes at token {start}); {REPREPARE}")

    def _fd(self, k: int) -> int:
        fd = self._files.pop(k, None)
        if fd is None:
            fd = os.open(self.shards[k].filename, os.O_RDONLY)
            while len(self._files) >= OPEN_FILES:  # a bounded number of descriptors
                os.close(self._files.pop(next(iter(self._files))))
        self._files[k] = fd
        return fd

    def __del__(self) -> None:
        for fd in getattr(self, "_files", {}).values():
            with contextlib.suppress(OSError):
                os.close(fd)

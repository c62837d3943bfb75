"""The order in which an epoch visits n items (the loader's windows; documents next): a seeded
bijection on [0, n), computed one position at a time, so that its memory and its set-up cost do
not depend on n.

    order = epoch_order(n, seed, epoch)      # Order; shuffle=False: 0, 1, 2, ...
    order.items(start, stop)                 # the items at positions start..stop-1, int64
    order(positions)                         # the items at any positions (an int64 array)

Every item is visited exactly once per epoch (a bijection), and the order is a pure function of
(n, seed, epoch, version): the same on every rank, at every world size, after every resume.

How (version 2). A Feistel network on k-bit integers, 2^(k-1) < n <= 2^k: the bits are cut into a
high and a low half, and each of 8 rounds XORs one half with a keyed hash (splitmix64's
finalizer) of the other, so every round, and the network, is a bijection on [0, 2^k). Positions
that land at n or above are sent through the network again until they land below n ("cycle
walking": the walk stays on the permutation's cycle, so the result is a bijection on [0, n);
since 2^k < 2n, it takes fewer than 2 passes on average). The round keys come from numpy's
SeedSequence of (seed, epoch). Memory: the positions asked for (`items` computes blocks of 65,536
positions and keeps two: 1 MB); time: ~10 vectorized passes over them.

Version 1 is the order of checkpoints written before: numpy's `permutation(n)` of a generator
seeded by (seed, epoch), n int64s built for the epoch (625 MB and seconds at 7.8e7 windows).
A run keeps the version its loader state records, so an old run resumes on exactly its order.
"""

from __future__ import annotations

import numpy as np

VERSION = 2  # what new runs use; the loader state records it
VERSIONS = (1, 2)
ROUNDS = 8
BLOCK = 1 << 16  # positions computed at a time by Feistel.items

_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


class Order:
    """Positions of one epoch -> items; subclasses define `__call__`."""

    def __init__(self, n: int):
        self.n = n

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def items(self, start: int, stop: int) -> np.ndarray:
        """The items at positions start..stop-1 (clipped to the epoch)."""
        return self(np.arange(max(0, start), min(stop, self.n), dtype=np.int64))


class Sequential(Order):
    """No shuffle: the items in their own order."""

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        return np.asarray(positions, dtype=np.int64)


class Feistel(Order):
    """Version 2: see the module docstring."""

    def __init__(self, n: int, seed: int, epoch: int):
        super().__init__(n)
        self.bits = max(2, int(n - 1).bit_length())  # 2^(bits-1) < n <= 2^bits (n >= 2)
        self.low_bits = self.bits // 2
        self.low_mask = np.uint64((1 << self.low_bits) - 1)
        self.high_mask = np.uint64((1 << (self.bits - self.low_bits)) - 1)
        self.keys = np.random.SeedSequence([seed, epoch]).generate_state(ROUNDS, np.uint64)
        self._blocks: dict[int, np.ndarray] = {}

    def _network(self, x: np.ndarray) -> np.ndarray:
        """One pass of the network over `x` (uint64 below 2^bits): a bijection on [0, 2^bits)."""
        shift = np.uint64(self.low_bits)
        high, low = x >> shift, x & self.low_mask
        for i, key in enumerate(self.keys):
            if i % 2 == 0:
                low = low ^ (_mix(high ^ key) & self.low_mask)
            else:
                high = high ^ (_mix(low ^ key) & self.high_mask)
        return (high << shift) | low

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        x = self._network(np.asarray(positions, dtype=np.uint64))
        outside = np.flatnonzero(x >= self.n)
        while len(outside):  # cycle walking
            x[outside] = self._network(x[outside])
            outside = outside[x[outside] >= self.n]
        return x.astype(np.int64)

    def items(self, start: int, stop: int) -> np.ndarray:
        """From blocks of BLOCK positions, each computed once (the last two kept: 1 MB): a
        network pass costs ~100 numpy calls whatever its length, so a step's few hundred
        positions are cut from a block rather than computed alone."""
        start, stop = max(0, start), min(stop, self.n)
        parts = []
        for b in range(start // BLOCK, (stop - 1) // BLOCK + 1 if stop > start else 0):
            block = self._blocks.get(b)
            if block is None:
                block = self(np.arange(b * BLOCK, min((b + 1) * BLOCK, self.n), dtype=np.int64))
                self._blocks = {**dict(list(self._blocks.items())[-1:]), b: block}
            parts.append(block[max(start - b * BLOCK, 0):stop - b * BLOCK])
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


class Stored(Order):
    """Version 1: the permutation of checkpoints written before version 2, built whole."""

    def __init__(self, n: int, seed: int, epoch: int):
        super().__init__(n)
        self.permutation = np.random.default_rng([seed, epoch]).permutation(n)

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        return self.permutation[np.asarray(positions, dtype=np.int64)]

    def items(self, start: int, stop: int) -> np.ndarray:
        return self.permutation[max(0, start):stop]


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: every output bit depends on every input bit (uint64, wrapping)."""
    x = x ^ (x >> np.uint64(30))
    x = x * _M1
    x = x ^ (x >> np.uint64(27))
    x = x * _M2
    return x ^ (x >> np.uint64(31))


def epoch_order(n: int, seed: int, epoch: int, shuffle: bool = True,
                version: int = VERSION) -> Order:
    """The order of epoch `epoch` over n items."""
    if version not in VERSIONS:
        raise ValueError(f"order version {version} is not one of {VERSIONS}")
    if not shuffle or n < 2:
        return Sequential(n)
    return Feistel(n, seed, epoch) if version == 2 else Stored(n, seed, epoch)

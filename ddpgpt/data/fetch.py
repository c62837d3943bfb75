"""Reading spans of a dataset's shards: pread(2) from a local directory (`LocalReader`), ranged
reads from object storage fetched ahead in the background, optionally kept in a local cache
(`RemoteReader`); storage.py says when each is used and why."""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np

from ddpgpt.files import atomic_write

OPEN_FILES = 256  # local shard files a reader keeps open at most (2e10 tokens: 200 shards)
CACHE_BLOCK = 1 << 20  # bytes per block of the local cache of remote shards
MIN_AHEAD, MAX_AHEAD = 4, 16  # steps whose windows are named at once, this one included
AHEAD_BYTES = 64 << 20  # bytes of windows a rank holds fetched ahead at most (one stream)
ARRIVALS = 32  # fetches whose arrival time the reader remembers (it answers their longest)


def ahead_steps(arrival_s: float, step_s: float, step_bytes: int,
                cap_bytes: int = AHEAD_BYTES) -> int:
    """How many steps' windows a loader keeps named to its reader, this step's included: the
    windows of step k+n must be asked for by the time step k starts if a fetch takes
    `arrival_s` (from being asked for to its last byte; the longest of the last ARRIVALS) and a
    step `step_s` (without its reads), n = ceil(arrival / step) + 1, the one beyond covering a
    fetch slower than those. At least MIN_AHEAD (also while either time is not known yet):
    three steps of slack for a request the store answers late (its latency's tail, a busy
    host), which costs little, a step's windows being ~2 KB each; at most MAX_AHEAD, and no
    more than `cap_bytes` of windows (`step_bytes` a step), but never fewer than this step and
    the next."""
    wanted = MIN_AHEAD
    if arrival_s > 0 and step_s > 0:
        wanted = max(MIN_AHEAD, math.ceil(arrival_s / step_s) + 1)
    return max(2, min(wanted, MAX_AHEAD, cap_bytes // max(1, step_bytes)))


class LocalReader:
    """pread(2) from a local directory's files, a bounded number of them open at once."""

    def __init__(self, files):
        self.files = files
        self._fds: dict[str, int] = {}  # name -> open descriptor, the most recent last

    def read(self, name: str, offset: int, into: np.ndarray) -> int:
        """Bytes offset.. of file `name` into the contiguous array `into`; returns the bytes
        read (fewer at the end of the file)."""
        return os.preadv(self._fd(name), [into], offset)

    arrival_s = 0.0  # nothing is fetched ahead (prefetch does nothing): no time to measure

    def prefetch(self, requests: list[tuple[str, int, int]]) -> None:
        """Nothing to do: the page cache reads ahead for a local disk."""

    def _fd(self, name: str) -> int:
        fd = self._fds.pop(name, None)
        if fd is None:
            fd = os.open(self.files.path / name, os.O_RDONLY)
            while len(self._fds) >= OPEN_FILES:
                os.close(self._fds.pop(next(iter(self._fds))))
        self._fds[name] = fd
        return fd

    def close(self) -> None:
        for fd in self._fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds = {}

    def __del__(self) -> None:
        self.close()


class RemoteReader:
    """Ranged reads of objects, the next ones fetched ahead by background threads, optionally
    kept in a local cache of whole blocks (see the module docstring).

    Each `prefetch` (a step's windows) is one batch of concurrent ranged GETs on a thread of
    its own, so the batches of several steps ahead are in flight together (the client's
    connection pool, storage.POOL_CONNECTIONS, carries them); `arrival_s` is the longest that
    one of the last ARRIVALS batches took from being asked for to its last byte, which the
    loader divides by its step time to know how far ahead to ask (`ahead_steps`)."""

    def __init__(self, files, cache: str = ""):
        self.files, self.cache = files, Path(cache) if cache else None
        self._pool = ThreadPoolExecutor(max_workers=MAX_AHEAD,
                                        thread_name_prefix="ddpgpt-prefetch")
        self._lock = threading.Lock()
        self._ready: dict[tuple[str, int, int], bytes] = {}  # fetched ahead, oldest first
        self._ready_bytes = 0
        self._pending: dict[tuple[str, int, int], Future] = {}
        self._arrivals: deque[float] = deque(maxlen=ARRIVALS)
        self.fetched_bytes = 0  # what came over the network (benchmarks, tests)

    @property
    def arrival_s(self) -> float:
        return max(self._arrivals, default=0.0)

    def read(self, name: str, offset: int, into: np.ndarray) -> int:
        key = (name, offset, into.nbytes)
        with self._lock:
            data = self._take(key)
            future = self._pending.get(key) if data is None else None
        if data is None and future is not None:
            future.result()  # the fetch ahead is under way: wait for it, not a second GET
            with self._lock:
                data = self._take(key)
        if data is None:
            data = self._fetch([key])[0]
        view = into.view(np.uint8).reshape(-1)
        view[:len(data)] = np.frombuffer(data, dtype=np.uint8)
        return len(data)

    def _take(self, key: tuple[str, int, int]) -> bytes | None:
        data = self._ready.pop(key, None)
        if data is not None:
            self._ready_bytes -= len(data)
        return data

    def prefetch(self, requests: list[tuple[str, int, int]]) -> None:
        """Starts fetching (name, offset, nbytes) spans in the background. What was fetched
        ahead and not read is kept up to 2 * AHEAD_BYTES (a loader asks for at most
        AHEAD_BYTES ahead): past that the oldest is dropped (spans a rollback skipped)."""
        with self._lock:
            keys = [k for k in dict.fromkeys(requests)
                    if k not in self._pending and k not in self._ready]
        if not keys:
            return
        future = self._pool.submit(self._ahead, keys, time.monotonic())
        with self._lock:
            self._pending = {k: f for k, f in self._pending.items() if not f.done()}
            self._pending.update({k: future for k in keys})

    def _ahead(self, keys: list[tuple[str, int, int]], asked: float) -> None:
        try:
            got = self._fetch(keys)
        except Exception:  # read again in the foreground, where its error is reported
            got = None
        with self._lock:
            if got is None:
                return
            self._arrivals.append(time.monotonic() - asked)
            for key, data in zip(keys, got):
                self._ready[key] = data
                self._ready_bytes += len(data)
            while self._ready_bytes > 2 * AHEAD_BYTES:
                self._take(next(iter(self._ready)))

    def _fetch(self, keys: list[tuple[str, int, int]]) -> list[bytes]:
        """The bytes of each (name, offset, nbytes), clipped to the object's end."""
        sizes = {name: self.files.size(name) for name, _, _ in keys}
        spans = [(n, o, min(o + k, sizes[n])) for n, o, k in keys]
        if self.cache is None:
            got = self.files.ranges(spans)
            self._count(got)
            return got
        return self._cached(spans, sizes)

    def _cached(self, spans: list[tuple[str, int, int]], sizes: dict[str, int]) -> list[bytes]:
        blocks = {(n, b) for n, s, e in spans for b in range(s // CACHE_BLOCK,
                                                             -(-e // CACHE_BLOCK))}
        have: dict[tuple[str, int], bytes] = {}
        for name, b in blocks:
            with contextlib.suppress(OSError):
                have[(name, b)] = self._block_path(name, b).read_bytes()
        todo = sorted(blocks - set(have))
        got = self.files.ranges([(n, b * CACHE_BLOCK, min(sizes[n], (b + 1) * CACHE_BLOCK))
                                 for n, b in todo])
        self._count(got)
        for (name, b), data in zip(todo, got):
            have[(name, b)] = data
            path = self._block_path(name, b)
            with contextlib.suppress(OSError):  # a full or read-only cache: read, not kept
                path.parent.mkdir(parents=True, exist_ok=True)
                with atomic_write(path) as f:
                    f.write(data)
        out = []
        for name, s, e in spans:
            parts = [have[(name, b)] for b in range(s // CACHE_BLOCK, -(-e // CACHE_BLOCK))]
            first = (s // CACHE_BLOCK) * CACHE_BLOCK
            out.append(b"".join(parts)[s - first:e - first])
        return out

    def _count(self, got: list[bytes]) -> None:
        with self._lock:
            self.fetched_bytes += sum(len(g) for g in got)

    def _block_path(self, name: str, block: int) -> Path:
        identity = self.files.identity(name)
        key = hashlib.sha256(f"{self.files.where(name)} {identity}".encode()).hexdigest()[:24]
        return self.cache / key / f"{block:08d}"

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

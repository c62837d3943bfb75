"""A checkpoint's tensors read from object storage with every byte range fetched concurrently.

DCP's reader (torch's FileSystemReader) opens each file and reads the items a load needs one
after the other through that one stream: from object storage, one connection's bandwidth (tens
of MB/s) and a round trip per block, so a node restoring a 1.5 GB state would take ~30 s at 50
MB/s where the store could give it many connections at once. `read_data` here fetches the items'
byte ranges first, cut into CHUNK-byte ranged GETs that go out together (fsspec's cat_ranges, on
the client's pool of storage.POOL_CONNECTIONS), BATCH bytes at a time so that host memory holds
one batch beyond the tensors themselves, then lets DCP's own code read each item from memory
(`Spans`): the same bytes, the same checks, only fetched in parallel.
"""

from __future__ import annotations

import contextlib
import io
import os
from bisect import bisect_right

from torch.distributed.checkpoint.planner import LoadPlan
from torch.futures import Future

CHUNK = 64 << 20  # bytes per ranged GET: a 1.5 GB state is 23 GETs at once (fewer, larger
# GETs than that cost as much on a real store, and far less on a server that reads the whole
# object for each range, as moto's does: docs/performance.md)
BATCH = 512 << 20  # bytes of items fetched before DCP reads them (and the next batch is fetched)


class Spans(io.RawIOBase):
    """A read-only, seekable file that holds only some byte ranges of a file: (start, bytes)
    chunks, sorted; reading outside them is a bug (the plan asked for what was not fetched)."""

    def __init__(self, chunks: list[tuple[int, bytes]]):
        super().__init__()
        self.chunks = sorted(chunks, key=lambda c: c[0])
        self.starts = [c[0] for c in self.chunks]
        self.pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = os.SEEK_SET, /) -> int:
        if whence == os.SEEK_CUR:
            offset += self.pos
        elif whence == os.SEEK_END:
            last, data = self.chunks[-1]
            offset += last + len(data)
        self.pos = offset
        return self.pos

    def readinto(self, b) -> int:
        view, filled = memoryview(b).cast("B"), 0
        while filled < len(view):
            i = bisect_right(self.starts, self.pos) - 1
            if i < 0 or self.pos >= self.starts[i] + len(self.chunks[i][1]):
                if filled:
                    break
                raise OSError(f"byte {self.pos} of a checkpoint file was not fetched")
            start, data = self.chunks[i]
            n = min(len(view) - filled, start + len(data) - self.pos)
            view[filled:filled + n] = data[self.pos - start:self.pos - start + n]
            filled += n
            self.pos += n
        return filled

    def read(self, size: int = -1) -> bytes:
        if size is None or size < 0:
            last, data = self.chunks[-1]
            size = max(0, last + len(data) - self.pos)
        out = bytearray(size)
        return bytes(out[:self.readinto(out)])


def batches(items: list, storage_data: dict) -> list[list]:
    """The plan's items in order of (file, offset), cut into runs of about BATCH bytes."""
    info = [(storage_data[i.storage_index], i) for i in items]
    info.sort(key=lambda x: (x[0].relative_path, x[0].offset))
    out, size = [[]], 0
    for md, item in info:
        if out[-1] and size + md.length > BATCH:
            out.append([])
            size = 0
        out[-1].append(item)
        size += md.length
    return [b for b in out if b]


def read_data(reader, plan: LoadPlan, planner, read) -> Future:
    """DCP's read_data (`read`: the parent class's) over `plan`, each batch of its items' bytes
    fetched concurrently first; `reader` is an FsspecReader (its fs wraps fsspec's). Returns
    DCP's completed future, as the parent's does."""
    fs, opened = reader.fs.fs, reader.fs.create_stream
    fetched: dict[str, Spans] = {}

    def create_stream(path, mode):
        if mode == "rb" and str(path) in fetched:
            return contextlib.nullcontext(fetched[str(path)])
        return opened(path, mode)

    reader.fs.create_stream = create_stream
    try:
        for items in batches(plan.items, reader.storage_data):
            paths, starts, ends = [], [], []
            for item in items:
                md = reader.storage_data[item.storage_index]
                path = str(reader.fs.concat_path(reader.path, md.relative_path))
                for s in range(md.offset, md.offset + md.length, CHUNK):
                    paths.append(path)
                    starts.append(s)
                    ends.append(min(s + CHUNK, md.offset + md.length))
            got = fs.cat_ranges(paths, starts, ends, on_error="raise")
            fetched.clear()
            per_file: dict[str, list[tuple[int, bytes]]] = {}
            for path, start, data in zip(paths, starts, got):  # (on_error="raise": all bytes)
                per_file.setdefault(path, []).append((start, data))
            fetched.update({p: Spans(c) for p, c in per_file.items()})
            read(LoadPlan(items=items, storage_data=plan.storage_data,
                          planner_data=plan.planner_data), planner)
    finally:
        reader.fs.create_stream = opened
        fetched.clear()
    done: Future = Future()
    done.set_result(None)
    return done

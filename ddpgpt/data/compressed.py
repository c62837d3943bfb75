"""Compressed inputs read as one stream that ends only where the file's compressed data ends.

gzip's reader already raises EOFError ("Compressed file ended before the end-of-stream marker was
reached") for a file cut short. zstandard's `stream_reader` does not: a truncated `.zst` reads as
a shorter file (the last line cut in the middle), and it stops after the first frame of a file
made of several (`cat a.zst b.zst`, pzstd's output). `open_zstd` reads every frame and raises the
same EOFError as gzip when the file ends inside one, so that a cut download is one line naming
the file, never a bad row or fewer documents.
"""

from __future__ import annotations

import io

from ddpgpt.files import require

READ_BYTES = 1 << 20  # compressed bytes read at a time
TRUNCATED = "Compressed file ended before the end-of-stream marker was reached"


class ZstdStream(io.RawIOBase):
    """The decompressed bytes of every frame of a .zst file, in order."""

    def __init__(self, path: str):
        import zstandard

        self._new = zstandard.ZstdDecompressor().decompressobj
        self._file = open(path, "rb")  # noqa: SIM115 (closed by close())
        self._frame = self._new()
        self._started = False  # some bytes of the current frame were fed
        self._out, self._at = b"", 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while self._at == len(self._out):
            data = self._file.read(READ_BYTES)
            if not data:
                if self._started:  # inside a frame: the file was cut short
                    raise EOFError(TRUNCATED)
                return 0
            self._out, self._at = self._feed(data), 0
        n = min(len(buffer), len(self._out) - self._at)
        buffer[:n] = self._out[self._at:self._at + n]
        self._at += n
        return n

    def _feed(self, data: bytes) -> bytes:
        """Decompresses `data`, across the frames it ends and begins."""
        out = []
        while data:
            out.append(self._frame.decompress(data))
            self._started = True
            if not self._frame.eof:
                break
            data = self._frame.unused_data  # the next frame's first bytes, if any
            self._frame, self._started = self._new(), False
        return b"".join(out)

    def close(self) -> None:
        self._file.close()
        super().close()


def open_zstd(path: str) -> io.BufferedReader:
    require("zstandard", "data", f"{path}: a .zst source")
    return io.BufferedReader(ZstdStream(path), READ_BYTES)


COMPRESSED = (".gz", ".zst")  # what open_any decompresses, by the file's name


def open_any(path: str):
    """A file's bytes as a binary stream: decompressed for a .gz or .zst name (a file cut short
    raises EOFError, a bad one OSError), else as they are."""
    import gzip

    name = path.lower()
    if name.endswith(".gz"):
        return gzip.open(path, "rb")
    if name.endswith(".zst"):
        return open_zstd(path)  # every frame; a file cut short is an EOFError, as gzip's
    return open(path, "rb")  # noqa: SIM115 (the caller closes it)

"""Durable files: fsync, sha256, atomic replacement, and write errors a person can act on.

A write that fails for a reason outside the program (a full disk, a read-only or vanished
directory, a quota) becomes a `WriteError`: one line naming the path and the OS's reason.
"""

from __future__ import annotations

import errno
import hashlib
import os
from pathlib import Path

from ddpgpt.errors import UserError


class WriteError(UserError):
    """A file or directory that could not be written (disk full, permissions, ...)."""

    exit_code = 1


def os_error_in(error: BaseException) -> OSError | None:
    """The OSError behind `error`, if any: torch's writer, for one, wraps the OS's error in a
    RuntimeError whose own message says only "unexpected pos"."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, OSError) and error.errno is not None:
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def describe(error: OSError) -> str:
    """"No space left on device (ENOSPC)"."""
    name = errno.errorcode.get(error.errno, str(error.errno))
    return f"{error.strerror or os.strerror(error.errno)} ({name})"


def fsync(path: Path) -> None:
    """Flushes a file's or a directory's contents (a directory: the names in it) to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes(path: Path, data: bytes) -> None:
    """Writes and fsyncs `path`; OSError on failure (the caller decides what it means)."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def replace_text(path: Path, text: str) -> None:
    """Replaces `path` atomically: a reader sees the old file or the new one, never a torn one."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write_bytes(tmp, text.encode())
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise WriteError(f"cannot write {path}: {describe(e)}") from None


def as_created(path: str | os.PathLike) -> None:
    """Gives `path` the mode open() gives a new file (0666 less the umask): safetensors' writer
    creates its files 0600, unlike every other file a command writes beside them."""
    mask = os.umask(0)  # reading the umask means setting it; put back at once
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)


def sha256(path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def writable_dir(path: Path, flag: str = "--out") -> Path:
    """`path`, created if need be and proven writable (a probe file written and removed), or
    one line naming `flag`: before any work whose results it would hold."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise UserError(f"{flag} {path}: cannot write there: {describe(e)}; give a directory you "
                        "can write to") from None
    return path


def pid_alive(pid: int) -> bool:
    """Whether a process with this id exists on this host (signal 0 checks without sending)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # it exists, owned by someone else
    return True

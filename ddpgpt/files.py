"""Durable files: fsync, sha256, the one atomic write (`atomic_write`; `replace_text` and
`copy_file` through it), the one publication of a whole directory (`publish_dir`), the one rename
of a path (`move`), write errors a person can act on, and the one message for an optional
package that is not installed (`require`). No other module renames a path.

A write that fails for a reason outside the program (a full disk, a read-only or vanished
directory, a quota) becomes a `WriteError`: one line naming the path and the OS's reason.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import importlib
import os
import shutil
import stat
import threading
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


def path_kind(path) -> str:
    """"dir", "file" (anything else that is there) or "missing" (as Path.exists says it), from
    one look at `path`: another process may make and remove a directory between two looks."""
    if not isinstance(path, Path):  # object storage: no directory to make or remove
        return "dir" if path.is_dir() else "file" if path.exists() else "missing"
    try:
        mode = path.stat().st_mode
    except OSError as e:
        if e.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
            return "missing"
        raise
    return "dir" if stat.S_ISDIR(mode) else "file"


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


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike):
    """`with atomic_write(path) as f: f.write(data)`: `path` is replaced whole or not at all. The
    bytes go to a temporary file beside it (.NAME.tmp-PID-THREAD: writers in other processes and
    threads do not collide), which is renamed over `path`; a reader sees the old file or the new
    one, never a torn one, and concurrent writers each rename a whole copy.

    The fsync policy, the same for every file written this way: the temporary file's data is
    fsynced before the rename, so a crash or power loss leaves the old file or the whole new one,
    never an empty or partial one under the name; the directory is fsynced after the rename, so
    the new name itself survives a power loss (a filesystem that cannot sync a directory is not
    an error: the rename, which readers see, has happened). On failure the temporary file is
    removed and the OSError raised: the caller says what it means (replace_text: a WriteError)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    try:
        with open(tmp, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    with contextlib.suppress(OSError):
        fsync(path.parent)


def replace_text(path: Path, text: str) -> None:
    """Replaces `path` atomically (atomic_write); a failure is a WriteError naming it."""
    try:
        with atomic_write(path) as f:
            f.write(text.encode())
    except OSError as e:
        raise WriteError(f"cannot write {path}: {describe(e)}") from None


def copy_file(source: str | os.PathLike, path: str | os.PathLike) -> None:
    """Copies `source` to `path` through atomic_write: `path` is the whole copy or absent (or as
    it was), never a torn one. OSError on failure."""
    with open(source, "rb") as src, atomic_write(path) as f:
        shutil.copyfileobj(src, f)


def move(source: str | os.PathLike, target: str | os.PathLike) -> Path:
    """Renames `source` to `target` on the same filesystem (os.rename: a file or a directory,
    whole, in one step; a file at `target` is replaced). Returns `target`. OSError on
    failure."""
    os.rename(source, target)
    return Path(target)


def as_created(path: str | os.PathLike) -> None:
    """Gives `path` the mode open() gives a new file (0666 less the umask): safetensors' writer
    creates its files 0600, unlike every other file a command writes beside them."""
    mask = os.umask(0)  # reading the umask means setting it; put back at once
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)


class NotMovedAside(OSError):
    """publish_dir could not move the directory it replaces aside: nothing has changed."""


def publish_dir(tmp: Path, final: Path, aside: Path | None = None) -> None:
    """Renames the complete directory `tmp` to `final` (a checkpoint, a prepared dataset, an
    export): a reader sees the old directory or the new one, never a mix. An existing `final` is
    first renamed to `aside` (default .NAME.old-PID beside it), renamed back if `tmp` cannot take
    its place, and deleted last. Syncing is the caller's: the contents before, the parent after
    (a checkpoint does both). OSError on failure; NotMovedAside when the old one could not be
    moved (a mount point, say)."""
    old = None
    if final.exists():
        old = aside or final.with_name(f".{final.name}.old-{os.getpid()}")
        try:
            os.rename(final, old)
        except OSError as e:
            raise NotMovedAside(e.errno, e.strerror, str(final)) from e
    try:
        os.rename(tmp, final)
    except OSError:
        if old is not None:
            os.rename(old, final)  # the previous copy stays
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def install(extra: str) -> str:
    """How to install one of ddpgpt's optional extras."""
    return f"pip install 'ddpgpt[{extra}]'"


def missing(module: str, extra: str, for_what: str, or_else: str = "") -> str:
    """The one line for an optional package that is not installed: "FOR_WHAT needs MODULE: pip
    install 'ddpgpt[EXTRA]'" and, if given, what else would do (`or_else`, e.g. " (or
    run.tracker = none)")."""
    return f"{for_what} needs {module.partition('.')[0]}: {install(extra)}{or_else}"


def require(module: str, extra: str, for_what: str, or_else: str = ""):
    """`module` imported, or a UserError with `missing`'s line (imported only where it is needed:
    the optional extras stay optional)."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise UserError(missing(module, extra, for_what, or_else)) from None


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


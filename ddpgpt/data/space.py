"""A full disk during `prepare`, from a worker encoding a unit or from the assembler writing the
shards: one line naming the file, the space left on its filesystem and about how much more the
dataset needs, instead of a traceback. Nothing is lost: the partial keeps what is done, and the
same command continues once there is room."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from pathlib import Path

from ddpgpt.files import WriteError

FULL = (errno.ENOSPC, errno.EDQUOT)


def _mb(n: int) -> str:
    return f"{n / 1e6:,.1f} MB"


def free_bytes(path: Path) -> int | None:
    """The bytes free on the filesystem of `path` (its nearest existing parent)."""
    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def needed_bytes(build) -> int | None:
    """About how many more bytes the shards need: the tokens per unit of the units assembled so
    far, times the plan's units, less what is written; before any unit, one token per byte of
    the inputs (exact for text under the byte tokenizer; compressed inputs hold more text than
    their size). llm.c shards: their tokens, exactly. None for a streamed source."""
    asm, plan = getattr(build, "asm", None), build.plan
    if asm is None:
        return None
    itemsize = 2 if asm.dtype == "uint16" else 4
    units, tokens = asm.whole
    if plan.llmc:
        total = sum(f["tokens"] for f in plan.files)
    elif units:
        total = tokens * len(plan.units) // units
    elif plan.text_bytes:
        total = plan.text_bytes
    else:
        return None
    return max(0, total - asm.tokens) * itemsize


def disk_full(error: OSError, where: Path, build=None) -> WriteError:
    path = error.filename or where
    free = free_bytes(Path(path))
    need = needed_bytes(build) if build is not None else None
    name = errno.errorcode.get(error.errno, str(error.errno))
    room = f"{_mb(free)} free there" if free is not None else "the space left unknown"
    more = f", and the dataset needs about {_mb(need)} more" if need is not None else ""
    kept = (f"What is done is kept in {where}: free space" if getattr(build, "done", 0) else
            "Nothing was done yet: free space (or give --out on another disk)")
    return WriteError(f"cannot write {path}: {error.strerror or os.strerror(error.errno)} "
                      f"({name}); {room}{more}. {kept}, then run the same command again to "
                      "continue")


@contextlib.contextmanager
def reported(where: Path, build=lambda: None):
    """Turns a full disk inside into its one line (`build()`: the Build, for the estimate)."""
    try:
        yield
    except OSError as e:
        if e.errno not in FULL:
            raise
        raise disk_full(e, where, build()) from None

"""`ddpgpt ARGS` run in the test's own process: `run_in_process(*args)` returns what
`tests.processes.run_cli(*args)` returns (a CompletedProcess: exit code, stdout, stderr), without
the ~2 CPU s a new process spends importing torch. For a property that is not about processes (an
error line, an exit code, what a command writes); `--nproc N` still starts its workers, whose output
lands in the same capture as a launcher's would.

What a command changes in the process that runs it is put back afterwards, so that the next test
(or the next command) meets the process as it was: the environment, the current directory,
sys.argv and sys.path, the signal handlers, torch's thread count, default dtype, matmul precision,
flushing of denormals and RNG state (numpy's and random's too), the warning filters, the levels,
handlers and filters of the loggers that existed before, a torch.distributed process group left
open, dynamo's compiled code and s3fs's cached clients (made under this command's environment).

Output is captured at the file descriptors 1 and 2, so that what torch's C++ side writes is seen as
the subprocess's pipes would see it, in order with Python's prints.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import subprocess
import sys
import tempfile
import traceback
import warnings
from contextlib import ExitStack, contextmanager
from pathlib import Path

import numpy as np

# SIGKILL and SIGSTOP cannot be caught; the rest are put back as they were.
_SIGNALS = [s for s in signal.valid_signals() if s not in (signal.SIGKILL, signal.SIGSTOP)]


def run_in_process(*args, env: dict | None = None, cwd: Path | None = None,
                   timeout: float | None = None) -> subprocess.CompletedProcess:
    """`ddpgpt ARGS` through `ddpgpt.cli.main` in this process, with `env` added to the
    environment and `cwd` as the current directory for its duration. `timeout` is accepted so
    that a call of run_cli switches by its name alone; the test's own timeout (pytest-timeout)
    bounds a command that hangs."""
    from ddpgpt import cli

    argv = [str(a) for a in args]
    with ExitStack() as stack:
        stack.enter_context(_restored_process(env, cwd, argv))
        stack.enter_context(_restored_torch())
        stack.enter_context(_restored_logging())
        out, err = stack.enter_context(_captured_fds())
        code = _exit_code(cli.main, argv)
    return subprocess.CompletedProcess(["ddpgpt", *argv], code, out.getvalue(), err.getvalue())


def _exit_code(main, argv: list[str]) -> int:
    """What the interpreter would exit with after main(argv): SystemExit's code (None: 0, a
    message: printed, 1), an uncaught exception's traceback on stderr and 1."""
    try:
        main(argv)
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    except Exception:  # noqa: BLE001  (what the interpreter prints for a bug)
        traceback.print_exc()
        return 1
    return 0


class _Text:
    """A captured stream's text, read once the command is done (filled in on the way out)."""

    def __init__(self):
        self.text = ""

    def getvalue(self) -> str:
        return self.text


@contextmanager
def _captured_fds():
    """fd 1 and 2 pointed at temporary files, sys.stdout and sys.stderr new text streams over them
    (unbuffered, as PYTHONUNBUFFERED=1 makes the subprocess's); all put back on the way out."""
    texts = (_Text(), _Text())
    saved_streams = sys.stdout, sys.stderr
    for stream in saved_streams:
        if stream is not None:
            stream.flush()
    with tempfile.TemporaryFile() as out_file, tempfile.TemporaryFile() as err_file:
        files = (out_file, err_file)
        saved = [os.dup(fd) for fd in (1, 2)]
        try:
            for fd, f in zip((1, 2), files):
                os.dup2(f.fileno(), fd)
            sys.stdout = open(1, "w", encoding="utf-8", closefd=False, buffering=1)
            sys.stderr = open(2, "w", encoding="utf-8", errors="backslashreplace",
                              closefd=False, buffering=1)
            sys.stdout.reconfigure(write_through=True)
            sys.stderr.reconfigure(write_through=True)
            yield texts
        finally:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except (OSError, ValueError):  # closed by the command
                    pass
            sys.stdout, sys.stderr = saved_streams
            for fd, copy in zip((1, 2), saved):
                os.dup2(copy, fd)
                os.close(copy)
            for text, f in zip(texts, files):
                f.seek(0)
                text.text = f.read().decode("utf-8", errors="replace")


@contextmanager
def _restored_process(env: dict | None, cwd: Path | None, argv: list[str]):
    """The environment, the current directory, sys.argv, sys.path, the signal handlers and the
    warning filters (and the registry of warnings said once) as they were."""
    environ, here = dict(os.environ), os.getcwd()
    sys_argv, sys_path = sys.argv[:], sys.path[:]
    handlers = {s: signal.getsignal(s) for s in _SIGNALS}
    once = dict(warnings.onceregistry)
    try:
        os.environ.update({k: str(v) for k, v in (env or {}).items()})
        if cwd is not None:
            os.chdir(cwd)
        sys.argv = ["ddpgpt", *argv]
        _drop_s3_clients()
        with warnings.catch_warnings():  # also starts each module's registry anew
            warnings.onceregistry.clear()
            yield
    finally:
        _drop_s3_clients()
        os.chdir(here)
        os.environ.clear()
        os.environ.update(environ)
        sys.argv[:], sys.path[:] = sys_argv, sys_path
        for s, handler in handlers.items():
            if handler is not None and signal.getsignal(s) is not handler:
                signal.signal(s, handler)
        warnings.onceregistry.clear()
        warnings.onceregistry.update(once)


def _drop_s3_clients() -> None:
    """s3fs's cached clients were made under some environment (endpoint, keys): none made before
    is used by the command, none it made is used after it."""
    if "s3fs" in sys.modules:
        sys.modules["s3fs"].S3FileSystem.clear_instance_cache()


@contextmanager
def _restored_torch():
    """torch's settings a command sets (threads, precision, RNG) as they were, a process group it
    left open destroyed, dynamo's caches emptied."""
    import torch

    threads, dtype = torch.get_num_threads(), torch.get_default_dtype()
    precision = torch.get_float32_matmul_precision()
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    deterministic = torch.are_deterministic_algorithms_enabled()
    denormals = flushes_denormals()
    groups = _group_count()
    rng = torch.get_rng_state(), np.random.get_state(), random.getstate()
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        torch.set_default_dtype(dtype)
        torch.set_float32_matmul_precision(precision)
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
        torch.use_deterministic_algorithms(deterministic)
        torch.set_flush_denormal(denormals)
        torch.set_rng_state(rng[0])
        np.random.set_state(rng[1])
        random.setstate(rng[2])
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        if groups is not None:  # an init_process_group that failed (a peer that never came)
            # counts a group that it never made: the next one in this process would then be
            # named "1" where a new process's peer says "0", and the two wait for each other
            torch.distributed.distributed_c10d._world.group_count = groups
        if "torch._dynamo" in sys.modules:
            sys.modules["torch._dynamo"].reset()


def _group_count() -> int | None:
    """torch.distributed's count of the groups this process made (it names each group), or None
    where torch has no such count."""
    try:
        from torch.distributed import distributed_c10d as c10d
    except ImportError:  # a torch built without torch.distributed
        return None
    return getattr(getattr(c10d, "_world", None), "group_count", None)


def flushes_denormals() -> bool:
    """Whether torch flushes denormal floats to zero (torch.set_flush_denormal, which a training
    sets and torch has no getter for): a denormal multiplied by one comes out zero."""
    import torch

    return (torch.tensor([1e-39]) * 1.0).item() == 0.0


@contextmanager
def _restored_logging():
    """The level, handlers, filters, propagation and disabled flag of the root logger and of every
    logger that existed before, and logging.disable's level. (A logger first made by the command's
    imports keeps what the import and the command gave it, as a second command in one process
    would find it.)"""
    manager = logging.root.manager
    loggers = [logging.root, *(lg for lg in manager.loggerDict.values()
                               if isinstance(lg, logging.Logger))]
    saved = [(lg, lg.level, lg.handlers[:], lg.filters[:], lg.propagate, lg.disabled)
             for lg in loggers]
    disabled = manager.disable
    try:
        yield
    finally:
        for lg, level, handlers, filters, propagate, off in saved:
            lg.setLevel(level)
            lg.handlers[:], lg.filters[:] = handlers, filters
            lg.propagate, lg.disabled = propagate, off
        logging.disable(disabled)

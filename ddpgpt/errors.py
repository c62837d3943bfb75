"""The one exception type for bad input: the command line prints its message as one line.

A `UserError` says what is wrong, where (file, field, rank) and what to do about it. It is for
problems a person can fix; bugs stay ordinary exceptions with a traceback.
"""

import errno
import os
import sys


class _Unbroken:
    """A text stream whose writes never raise once its reader is gone: `train ... | tee log`,
    then Ctrl-C, stops tee with the same SIGINT, and a stop message or a progress bar written
    to the closed pipe would raise BrokenPipeError wherever the run happened to be, costing the
    checkpoint the stop was for. From the first such write, output goes to /dev/null (also the
    file descriptor, so that the interpreter's own flush at exit cannot fail either)."""

    def __init__(self, stream):
        self._stream = stream

    def _lost(self) -> None:
        try:
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, self._stream.fileno())
            os.close(null)
        except (OSError, ValueError):
            pass

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError as e:
            if e.errno not in (errno.EPIPE, errno.ECONNRESET):
                raise
            self._lost()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as e:
            if e.errno not in (errno.EPIPE, errno.ECONNRESET):
                raise
            self._lost()
            self._stream.flush()

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def survive_closed_output() -> None:
    """Standard output and error that outlive their reader (see _Unbroken)."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, _Unbroken):
            setattr(sys, name, _Unbroken(stream))


def say(line: str) -> None:
    """A line on stderr for the person at the terminal, written above any progress bar drawn
    there (tqdm.write takes the bar away, writes, and draws it again), never over it: every
    status line goes through here, or through warn."""
    from tqdm import tqdm

    tqdm.write(line, file=sys.stderr)


def warn(message: str) -> None:
    """One line on stderr for something that does not stop the command."""
    say(f"ddpgpt: warning: {message}")


class UserError(Exception):
    """Bad input, reported as one line on stderr ("ddpgpt: <label>: ...") with exit code
    `exit_code`. `quiet` errors print nothing: another rank reports the same event."""

    exit_code = 2
    label = "error"
    storage = ""  # the URL whose object storage failed, when that is what this is (storage.failing)

    def __init__(self, message: str = "", quiet: bool = False):
        super().__init__(message)
        self.quiet = quiet


class DataError(UserError):
    """A dataset directory or shard that is missing, malformed or inconsistent."""


class ChatError(UserError):
    """A model, tokenizer or dataset that cannot hold a conversation where one is needed (no
    chat template tokens, no loss masks)."""


def closest(word: str, choices) -> str | None:
    """The choice closest to a mistyped `word` (difflib's ratio at least 0.6), or else the one
    of the same letters in another order (`tyni`: tiny, whose ratio is 0.5), or None."""
    import difflib

    choices = [str(c) for c in choices]
    close = difflib.get_close_matches(str(word), choices, n=1, cutoff=0.6)
    same = [c for c in choices if sorted(c.lower()) == sorted(str(word).lower())]
    return close[0] if close else same[0] if same else None


def did_you_mean(word: str, choices) -> str:
    """" (did you mean X?)" for the choice closest to a mistyped `word`, or ""."""
    meant = closest(word, choices)
    return f" (did you mean {meant}?)" if meant else ""


def beside(path, marker: str, what: str) -> str:
    """For a path that does not exist: " (did you mean X?)" naming the directory next to it (in
    its parent) that holds `marker` and whose name is closest, or " (WHAT beside it: A, B)"
    listing them all, or "" when there are none: the datasets (meta.json) or runs (checkpoints) a
    mistyped path was meant to name."""
    from pathlib import Path

    parent = Path(path).parent
    try:
        there = sorted(p.parent for p in parent.glob(f"*/{marker}"))
    except OSError:
        return ""
    meant = closest(Path(path).name, [p.name for p in there])
    if meant:
        return f" (did you mean {parent / meant}?)"
    return f" ({what} beside it: {', '.join(map(str, there))})" if there else ""

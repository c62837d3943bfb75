"""Progress bars that also work in a log file: tqdm on a terminal; elsewhere (a pipe, a file, a
batch job's log) one whole line at most every LOG_EVERY_S seconds and one at the end, instead of
a bar redrawn with carriage returns that a log shows as one endless line. Work done within
LOG_EVERY_S leaves no line at all: a quick command (or one that fails at once) logs only what it
says itself."""

from __future__ import annotations

import re
import sys
import time

from tqdm import tqdm

LOG_EVERY_S = 10.0
# what a redraw changes by itself: the bar's glyphs (their width follows the rate's) and the
# clock and rate ("|####  | ... [00:12<01:30, 3.97it/s")
_REDRAWN = re.compile(r"\|[^|]*\||\[[^],<]*<[^],]*(, *[^],=]*/s)?")


class _Lines:
    """A stream for tqdm that turns each redraw into one line of its own."""

    def __init__(self, stream):
        self.stream, self.started, self.last = stream, time.monotonic(), ""

    def write(self, text: str) -> int:
        line = text.replace("\r", "").strip()
        if line and time.monotonic() - self.started >= LOG_EVERY_S:
            # tqdm's close redraws the last update: the same line but for what a redraw changes
            same = _REDRAWN.sub("", line)
            if same != self.last:
                self.stream.write(line + "\n")
            self.last = same
        return len(text)

    def flush(self) -> None:
        self.stream.flush()


def bar(iterable=None, total: int | None = None, stream=None, **kwargs) -> tqdm:
    """tqdm(iterable, total, **kwargs) on stderr (or `stream`), as above when that is not a
    terminal."""
    stream = stream or sys.stderr
    if stream.isatty():
        return tqdm(iterable, total=total, file=stream, dynamic_ncols=True, **kwargs)
    return tqdm(iterable, total=total, file=_Lines(stream), mininterval=LOG_EVERY_S,
                maxinterval=1e9, ncols=100, **kwargs)

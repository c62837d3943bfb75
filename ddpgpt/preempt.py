"""Pre-emption: the first SIGTERM or SIGINT asks the ranks to stop at the next step boundary,
with a checkpoint; a second one exits at once.

The ranks agree on the stop through the flag they exchange after every step (see train.loop), so
a signal that reaches only one rank stops them all at the same step. A second signal within
`GRACE_S` of the first counts as the same event: launchers (torchrun, SLURM) forward to workers a
signal the workers may already have received, and that must not turn a clean stop into a kill.
"""

from __future__ import annotations

import os
import signal
import sys
import time

EXIT_PREEMPTED = 75  # sysexits' EX_TEMPFAIL: stopped early on request, checkpoint saved; rerun to resume
GRACE_S = 1.0
SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignal:
    """Catches SIGTERM/SIGINT for the duration of a `with` block."""

    def __init__(self, announce: bool = True):
        self.signum: int | None = None
        self.when = 0.0
        self.announce = announce
        self._previous: dict = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else ""

    def _handle(self, signum, frame) -> None:
        now = time.monotonic()
        if self.signum is None:
            self.signum, self.when = signum, now
            if self.announce:
                print(f"ddpgpt: {signal.Signals(signum).name}: stopping after this step with a checkpoint; "
                      "send it again to exit at once", file=sys.stderr, flush=True)
        elif now - self.when > GRACE_S:  # a second, deliberate signal: die by it now
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    def __enter__(self) -> StopSignal:
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

"""Stop requests: which signals ask a run to stop at the next step boundary."""

from __future__ import annotations

import os
import signal

import pytest

from ddpgpt.reliability import StopSignal


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT],
                         ids=lambda s: s.name)
def test_each_stop_signal_is_a_stop_request(sig):
    """SIGHUP (a closed terminal, a launcher hung up on) and SIGQUIT used to kill the workers
    without a checkpoint; every one of these is now a request to stop with one."""
    before = signal.getsignal(sig)
    with StopSignal(announce=False) as stop:
        assert not stop.requested
        os.kill(os.getpid(), sig)
        # a launcher forwarding what the worker already got: the same event
        os.kill(os.getpid(), sig)
        assert stop.requested and stop.name == sig.name
    assert signal.getsignal(sig) == before  # handlers restored after the run

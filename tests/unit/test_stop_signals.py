"""Stop requests: which signals ask a run to stop at the next step boundary."""

from __future__ import annotations

import os
import signal

import pytest

from ddpgpt.guard.health import StopSignal


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


@pytest.mark.parametrize("on_nonfinite, lr_fields, advice", [
    ("stop", "optim.lr", "lower optim.lr or raise optim.warmup_steps, or use --on-nonfinite skip"),
    ("skip", "optim.lr or optim.muon_lr",
     "lower optim.lr or optim.muon_lr or raise optim.warmup_steps, or raise run.max_skipped"),
])
def test_the_nonfinite_stop_advises_what_is_not_already_on(on_nonfinite, lr_fields, advice):
    """With skipping on, advising --on-nonfinite skip says nothing; under Muon the matrices'
    learning rate is optim.muon_lr."""
    from ddpgpt.config.schema import RunConfig
    from ddpgpt.distributed.group import DistEnv, DistError
    from ddpgpt.guard.health import Guard

    guard = Guard(DistEnv(), RunConfig(on_nonfinite=on_nonfinite, max_skipped=0),
                  StopSignal(announce=False), lr_fields)
    with pytest.raises(DistError) as e:
        guard.on_nonfinite(4, [1])
    assert str(e.value).endswith(f"No checkpoint before it is known healthy: --reset starts "
                                 f"over; {advice}")


def test_the_healthy_checkpoint_advice_is_a_sentence_of_its_own(tmp_path):
    """Without a suspect checkpoint the advice starts the sentence (after "... step. ")."""
    from ddpgpt.config.schema import RunConfig
    from ddpgpt.distributed.group import DistEnv
    from ddpgpt.guard.health import Guard

    (tmp_path / "step_0000001").mkdir()
    guard = Guard(DistEnv(), RunConfig(), StopSignal(announce=False), "optim.lr", tmp_path)
    assert guard.healthy_checkpoint(5) == (
        f"The newest healthy checkpoint is {tmp_path / 'step_0000001'}: to resume from it, run "
        f"the same command with --resume {tmp_path / 'step_0000001'}")

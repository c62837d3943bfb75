"""Fault injection for the reliability tests; a real run never sets DDPGPT_FAULT.

    DDPGPT_FAULT="ACTION@STEP" or "ACTION@STEP@RANK" (rank 0 by default)

makes that rank do ACTION when STEP steps are complete and the next one is about to start, on the
job's first attempt only (never after an elastic restart, so a restarted job can finish):

    kill         SIGKILL itself: a crash (OOM killer, lost node)
    term         SIGTERM itself: a pre-emption
    term2        SIGTERM itself, then again after the duplicate window: the second must exit at once
    parent:SIG   send SIG (INT, HUP, QUIT, TERM, KILL) to its parent, the launcher
    stall        stop responding (sleeps): a hung rank
    nan          its loss for that step becomes NaN
    kill-saving  SIGKILL itself when the checkpoint of step STEP is being taken (its state
                 gathered): a crash in the middle of a save

`install` wraps the trainer's step from the outside; the training loop knows nothing of this.
"""

from __future__ import annotations

import os
import signal
import time

from ddpgpt.reliability import GRACE_S

ACTIONS = ("kill", "term", "term2", "stall", "nan", "kill-saving")


def parse(spec: str, rank: int) -> tuple[str, int] | None:
    """(action, step) for this rank, or None."""
    action, step, *who = spec.split("@")
    if action not in ACTIONS and not action.startswith("parent:"):
        raise ValueError(f"DDPGPT_FAULT: unknown action {action!r}; one of "
                         f"{', '.join(ACTIONS)}, parent:SIG")
    return (action, int(step)) if int(who[0] if who else 0) == rank else None


def act(action: str, step: int) -> None:
    print(f"fault: {action} at step {step} ({time.time():.3f})", flush=True)
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action in ("term", "term2"):
        os.kill(os.getpid(), signal.SIGTERM)
        if action == "term2":
            time.sleep(GRACE_S + 0.5)
            os.kill(os.getpid(), signal.SIGTERM)
    elif action.startswith("parent:"):
        os.kill(os.getppid(), getattr(signal, "SIG" + action.split(":")[1]))
    elif action == "stall":
        while True:
            time.sleep(3600)


def install(trainer) -> None:
    """Wraps `trainer.train_step` with the fault DDPGPT_FAULT names for this rank, if any."""
    fault = parse(os.environ["DDPGPT_FAULT"], trainer.env.rank)
    if fault is None or not trainer.env.first_attempt:
        return
    action, at = fault
    if action == "kill-saving":
        state_dict = trainer.state_dict

        def dying_state_dict():
            if trainer.step == at:
                act("kill", at)
            return state_dict()

        trainer.state_dict = dying_state_dict
        return
    step = trainer.train_step

    def faulty_step():
        if trainer.step == at and action != "nan":
            act(action, at)
        loss, norm = step()
        if trainer.step == at and action == "nan":
            loss = loss * float("nan")
        return loss, norm

    trainer.train_step = faulty_step

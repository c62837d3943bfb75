"""Fault injection for the reliability tests; a real run never sets DDPGPT_FAULT.

    DDPGPT_FAULT="ACTION@STEP" or "ACTION@STEP@RANK" (rank 0 by default)

makes that rank do ACTION when STEP steps are complete and the next one is about to start, on the
first attempt only (never after an elastic restart, so a restarted job can finish):

    kill     SIGKILL itself: a crash (OOM killer, lost node)
    term     SIGTERM itself: a pre-emption
    term2    SIGTERM itself, then again after the duplicate window: the second must exit at once
    intparent  SIGINT to its parent, the launcher, which forwards it to every worker
    stall    stop responding (sleeps): a hung rank
    nan      its loss for that step becomes NaN
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

import torch

from ddpgpt.preempt import GRACE_S

ACTIONS = ("kill", "term", "term2", "intparent", "stall", "nan")


@dataclass
class Fault:
    action: str | None = None
    step: int = -1

    @classmethod
    def from_env(cls, rank: int, restart_count: int) -> Fault:
        spec = os.environ.get("DDPGPT_FAULT", "")
        if not spec or restart_count > 0:
            return cls()
        action, step, *who = spec.split("@")
        if action not in ACTIONS:
            raise ValueError(f"DDPGPT_FAULT: unknown action {action!r}; one of {', '.join(ACTIONS)}")
        return cls(action, int(step)) if int(who[0] if who else 0) == rank else cls()

    def before_step(self, step: int) -> None:
        """Called with the number of completed steps, before the next one starts."""
        if step != self.step or self.action in (None, "nan"):
            return
        print(f"fault: {self.action} at step {step} ({time.time():.3f})", flush=True)
        if self.action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif self.action in ("term", "term2"):
            os.kill(os.getpid(), signal.SIGTERM)
            if self.action == "term2":
                time.sleep(GRACE_S + 0.5)
                os.kill(os.getpid(), signal.SIGTERM)
        elif self.action == "intparent":
            os.kill(os.getppid(), signal.SIGINT)
        elif self.action == "stall":
            while True:
                time.sleep(3600)

    def poison(self, loss: torch.Tensor, step: int) -> torch.Tensor:
        return loss * float("nan") if self.action == "nan" and step == self.step else loss

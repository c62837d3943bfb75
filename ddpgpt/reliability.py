"""What keeps a run's ranks together through trouble: stop requests (pre-emption), the health
exchange after every step, and the errors that end the ranks together.

Pre-emption. The first SIGTERM, SIGINT, SIGHUP or SIGQUIT asks the ranks to stop at the next step
boundary with a checkpoint; a second one exits at once. A second signal within `GRACE_S` of the
first counts as the same event: launchers (torchrun, SLURM) forward to workers a signal the
workers may already have received, and that must not turn a clean stop into a kill.

The exchange. After every step the ranks all-gather one small tensor per rank: its loss, whether
its loss and gradient norm are finite, and whether it was asked to stop. From it every rank logs
the same global loss, skips or stops on a non-finite value, and stops for pre-emption, all at the
same step: a signal that reaches one rank stops them all.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass

import torch

from ddpgpt import dist
from ddpgpt.config import RunConfig
from ddpgpt.errors import UserError, warn

# sysexits' EX_TEMPFAIL: stopped early on request, checkpoint saved; rerun to resume
EXIT_PREEMPTED = 75
GRACE_S = 1.0
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)


class Preempted(UserError):
    """The ranks stopped together on a signal after writing a checkpoint."""

    exit_code = EXIT_PREEMPTED
    label = "stopped"


class StopSignal:
    """Catches the stop signals for the duration of a `with` block."""

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
                print(f"ddpgpt: {signal.Signals(signum).name}: stopping after this step with a "
                      "checkpoint; send it again to exit at once", file=sys.stderr, flush=True)
        elif now - self.when > GRACE_S:  # a second, deliberate signal: die by it now
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    def __enter__(self) -> StopSignal:
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def resume_hint(resume: str, run_dir: str) -> str:
    """The command that continues a stopped run, for a run started with `run.resume = resume`."""
    if resume == "reset":
        return "run the same command without --reset to resume"
    if resume == "never":
        return "run the same command with --resume auto to resume"
    if resume != "auto":  # an explicit checkpoint: reruns continue from the run dir (see resume.py)
        return (f"run the same command to resume (it continues from {run_dir}, not from "
                "--resume again)")
    return "run the same command to resume"


@dataclass
class Health:
    """What the ranks agreed on after a step."""

    loss: float              # the global mean loss (meaningless when `bad` is not empty)
    bad: list[int]           # the ranks that saw a non-finite loss or gradient norm
    stop: bool               # some rank was asked to stop


class Guard:
    """The exchange after each step, and the decision on non-finite values: skip or stop."""

    def __init__(self, env: dist.DistEnv, cfg: RunConfig, stop: StopSignal,
                 lr_fields: str = "optim.lr"):
        """`lr_fields`: the learning rates to name in advice ("optim.lr or optim.muon_lr")."""
        self.env, self.cfg, self.signal, self.lr_fields = env, cfg, stop, lr_fields
        self.skipped = 0  # steps skipped in the run so far (saved in checkpoints)

    def exchange(self, loss: torch.Tensor, norm: torch.Tensor, scaled: bool) -> Health:
        """The one collective of a step. `scaled`: fp16 with a GradScaler, which skips steps
        whose gradients overflow by itself, so only the loss counts."""
        finite = torch.isfinite(loss) & (torch.isfinite(norm) | scaled)
        stop = torch.tensor(float(self.signal.requested), device=loss.device)
        rows = dist.all_gather(self.env,
                               torch.stack([loss.float(), finite.float(), stop])).cpu()  # (W, 3)
        bad = [r for r in range(self.env.world_size) if not rows[r, 1]]
        return Health(rows[:, 0].mean().item(), bad, bool(rows[:, 2].any()))

    def on_nonfinite(self, step: int, bad: list[int], last_checkpoint: int) -> None:
        """Every rank takes the same branch: raise (stop) or count a skipped step."""
        where = f"step {step}: non-finite loss or gradient norm on rank {', '.join(map(str, bad))}"
        kept = f"step {last_checkpoint}" if last_checkpoint >= 0 else "none yet"
        if self.cfg.on_nonfinite == "stop" or self.skipped >= self.cfg.max_skipped:
            tune = f"lower {self.lr_fields} or raise optim.warmup_steps"
            if self.cfg.on_nonfinite == "stop":
                why, advice = "", f"{tune}, or use --on-nonfinite skip"
            else:  # skipping already: more of it, or fewer non-finite steps
                why = f" after {self.skipped} skipped steps (run.max_skipped)"
                advice = f"{tune}, or raise run.max_skipped"
            raise dist.DistError(f"{where}; stopped before the optimizer step{why}. The last "
                                 f"checkpoint ({kept}) is intact; {advice}",
                                 quiet=not self.env.is_main)
        self.skipped += 1
        if self.env.is_main:
            warn(f"{where}; skipped ({self.skipped} of at most {self.cfg.max_skipped})")

    def state_dict(self) -> dict:
        return {"skipped": self.skipped}

    def load_state_dict(self, state: dict) -> None:
        self.skipped = int(state["skipped"])


def preempted(step: int, signal_name: str, checkpoint_dir, hint: str, quiet: bool) -> Preempted:
    return Preempted(f"at step {step} on {signal_name or 'a signal to another rank'}; "
                     f"checkpoint {checkpoint_dir} is complete: {hint}", quiet=quiet)


def collective_failed(error: dist.CollectiveError, env: dist.DistEnv, during: str,
                      timeout_s: float) -> dist.DistError:
    """The one line for a collective that failed `during` ("step 7", "the checkpoint of step
    6"): this rank lost a peer."""
    return dist.DistError(f"{during}: a collective failed on rank {env.rank} ({error}); "
                          f"another rank stalled or died (see its log). Collectives wait at most "
                          f"run.dist_timeout_s = {timeout_s:g} s")

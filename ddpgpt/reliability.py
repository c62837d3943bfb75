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
from ddpgpt.spike import Spike, SpikeDetector

# sysexits' EX_TEMPFAIL: stopped early on request, checkpoint saved; rerun to resume
EXIT_PREEMPTED = 75
GRACE_S = 1.0
SETTLE_S = 5.0  # how long a stopped rank waits for its agent's own SIGTERM (see settle_stop)
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


def resume_hint(resume: str, run_dir: str, elastic: bool = False) -> str:
    """The command that continues a stopped run, for a run started with `run.resume = resume`.
    `elastic`: under torchrun with a --nnodes range, where a stop is also how the agents
    change the group's membership."""
    if elastic:
        return ("if torchrun stopped the group for a node that joins, the new group resumes "
                f"from it by itself; else {resume_hint(resume, run_dir)}")
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
    saved: bool = True       # no rank has a checkpoint save still running (saver.py)


class Guard:
    """The exchange after each step, and what a bad step leads to: the update, a skipped step, a
    rollback (spike.py) or a stop."""

    def __init__(self, env: dist.DistEnv, cfg: RunConfig, stop: StopSignal,
                 lr_fields: str = "optim.lr"):
        """`lr_fields`: the learning rates to name in advice ("optim.lr or optim.muon_lr")."""
        self.env, self.cfg, self.signal, self.lr_fields = env, cfg, stop, lr_fields
        self.skipped = 0  # steps skipped in the run so far (saved in checkpoints)
        self.spikes = SpikeDetector(cfg)  # saved in checkpoints by the trainer, as "spike"

    def exchange(self, loss: torch.Tensor, norm: torch.Tensor, scaled: bool,
                 saving: bool = False) -> Health:
        """The one collective of a step. `scaled`: fp16 with a GradScaler, which skips steps
        whose gradients overflow by itself, so only the loss counts. `saving`: this rank's
        checkpoint save is still running in the background."""
        finite = torch.isfinite(loss) & (torch.isfinite(norm) | scaled)
        flags = torch.tensor([float(self.signal.requested), float(saving)], device=loss.device)
        rows = dist.all_gather(self.env, torch.cat([loss.float().view(1), finite.float().view(1),
                                                    flags])).cpu()  # (W, 4)
        bad = [r for r in range(self.env.world_size) if not rows[r, 1]]
        return Health(rows[:, 0].mean().item(), bad, bool(rows[:, 2].any()),
                      not bool(rows[:, 3].any()))

    def judge(self, step: int, health: Health, last_checkpoint: int) -> str | Spike:
        """What step `step` (1-based) leads to, the same on every rank: "update", "skip" (a
        non-finite step, with on_nonfinite = skip), or a Spike to roll back from; a stop
        raises. A non-finite value is a spike unless on_nonfinite says otherwise."""
        if health.bad and self.cfg.on_nonfinite != "spike":
            self.on_nonfinite(step, health.bad, last_checkpoint)
            return "skip"
        if health.bad:
            spike = self.spikes.nonfinite(step, health.loss, health.bad)
        elif self.cfg.on_spike == "none":
            self.spikes.losses.append(health.loss)
            return "update"
        elif (spike := self.spikes.check(step, health.loss)) is None:
            return "update"
        cfg, recent = self.cfg, self.spikes.recent(step)
        if cfg.on_spike == "rollback" and recent < cfg.max_rollbacks:
            return spike
        if cfg.on_spike == "rollback":
            why = (f" after {recent} rollback{'s' if recent != 1 else ''} within "
                   f"{cfg.rollback_window} steps (run.max_rollbacks = {cfg.max_rollbacks})")
            advice = "or raise run.max_rollbacks"
        else:
            why, advice = f" (run.on_spike = {cfg.on_spike})", "or use --run.on-spike rollback"
        self._stop(f"step {step}: {spike.describe(cfg, len(self.spikes.losses))}", why, advice,
                   last_checkpoint)

    def _stop(self, where: str, why: str, advice: str, last_checkpoint: int) -> None:
        kept = f"step {last_checkpoint}" if last_checkpoint >= 0 else "none yet"
        raise dist.DistError(f"{where}; stopped before the optimizer step{why}. The last "
                             f"checkpoint ({kept}) is intact; lower {self.lr_fields} or raise "
                             f"optim.warmup_steps, {advice}", quiet=not self.env.is_main)

    def on_nonfinite(self, step: int, bad: list[int], last_checkpoint: int) -> None:
        """Every rank takes the same branch: raise (stop) or count a skipped step."""
        where = f"step {step}: non-finite loss or gradient norm on rank {', '.join(map(str, bad))}"
        if self.cfg.on_nonfinite == "stop":
            self._stop(where, "", "or use --on-nonfinite skip", last_checkpoint)
        if self.skipped >= self.cfg.max_skipped:  # skipping already: more, or fewer bad steps
            self._stop(where, f" after {self.skipped} skipped steps (run.max_skipped)",
                       "or raise run.max_skipped", last_checkpoint)
        self.skipped += 1
        if self.env.is_main:
            warn(f"{where}; skipped ({self.skipped} of at most {self.cfg.max_skipped})")

    def settle_stop(self) -> None:
        """After a stop checkpoint, on a rank that no signal reached: wait a little for its own.
        torchrun's agents stop their workers with SIGTERM when a node joins, each agent when it
        notices; a rank that exits first (stopped through the exchange) would make a slower
        agent count a failure, and spend one of its --max-restarts, instead of the change."""
        if self.signal.requested or self.env.world_size == self.env.local_world_size \
                or self.env.launcher is None:
            return
        deadline = time.monotonic() + SETTLE_S
        while not self.signal.requested and time.monotonic() < deadline:
            time.sleep(0.05)

    def reset(self) -> None:
        """The state of a run's first step (a rollback to the start, or before a load)."""
        self.skipped = 0
        self.spikes.load_state_dict(None)

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

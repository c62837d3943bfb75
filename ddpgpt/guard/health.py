"""What keeps a run's ranks together through trouble: stop requests (pre-emption), the health
exchange after every step, and the errors that end the ranks together.

Pre-emption. The first SIGTERM, SIGINT, SIGHUP or SIGQUIT asks the ranks to stop at the next step
boundary with a checkpoint; a second one exits at once. A second signal within `GRACE_S` of the
first counts as the same event: launchers (torchrun, SLURM) forward to workers a signal the
workers may already have received, and that must not turn a clean stop into a kill.

The exchange. After every step the ranks all-gather one small tensor per rank: its loss, whether
its loss and gradient norm are finite, whether it was asked to stop, and the seconds it waited
for its data and for checkpoints (metrics.jsonl's data_wait_s, ckpt_wait_s: the max over
ranks). From it every rank logs the same global loss, skips or stops on a non-finite value, and
stops for pre-emption, all at the same step: a signal that reaches one rank stops them all.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ddpgpt.checkpoint import store
from ddpgpt.checkpoint.saver import SaveFailed, Saver
from ddpgpt.config.schema import RunConfig
from ddpgpt.distributed import collectives
from ddpgpt.distributed.group import CollectiveError, DistEnv, DistError
from ddpgpt.errors import UserError, warn
from ddpgpt.guard import verdict
from ddpgpt.guard.spike import Spike, SpikePolicy, Verdict

# sysexits' EX_TEMPFAIL: stopped early on request, checkpoint saved; rerun to resume
EXIT_PREEMPTED = 75
# trained to the end, checkpoints written, but the run is not healthy (Guard.end): no model to ship
EXIT_UNHEALTHY = 3
GRACE_S = 1.0
SETTLE_S = 5.0  # how long a stopped rank waits for its agent's own SIGTERM (see settle_stop)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)


class Preempted(UserError):
    """The ranks stopped together on a signal after writing a checkpoint."""

    exit_code = EXIT_PREEMPTED
    label = "stopped"


class Unhealthy(UserError):
    """The run trained to its end but did not end healthy (Guard.end): its one line, and an
    exit status a script or scheduler can act on."""

    exit_code = EXIT_UNHEALTHY
    label = "unhealthy"


class Halted(UserError):
    """The run stopped for something outside it (a checkpoint it could not write, object storage
    gone): a run-time failure, said in one line by `halted`."""

    exit_code = 1


def halted(during: str, error: UserError, kept: int, fix: str, hint: str) -> Halted:
    """The one line of a run stopped `during` ("step 7", "the checkpoint of step 6") by `error`:
    the newest complete checkpoint (step `kept`; -1: none) is intact, what to do first (`fix`),
    then how to go on (`hint`, resume_hint's)."""
    intact = f"step {kept}" if kept >= 0 else "none yet"
    return Halted(f"{during}: {error}. The last complete checkpoint ({intact}) is intact: {fix}, "
                  f"then {hint}", quiet=error.quiet)


@contextlib.contextmanager
def saving(trainer, saver: Saver, run_dir: str):
    """Around what may finish a save or meet object storage (a training's steps, its saves):
    trainer.last_checkpoint kept at the newest step published; a failed save (SaveFailed) or
    object storage failing (UserError.storage: the server gone, credentials expired) as the
    one line every rank raises (rank 0 prints it), naming the step or what the run was doing
    (trainer.doing). Also a decorator: a function that runs inside it."""
    try:
        yield
    except UserError as e:
        failed = isinstance(e, SaveFailed)
        if not (failed or e.storage):
            raise
        kept = max(trainer.last_checkpoint, saver.newest)
        raise halted(f"step {e.step}" if failed else trainer.doing, e, kept,
                     e.fix if failed else "wait until the storage answers",
                     resume_hint(trainer.cfg.run.resume, run_dir, none_yet=kept < 0)) from None
    finally:
        trainer.last_checkpoint = max(trainer.last_checkpoint, saver.last)


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


def resume_hint(resume: str, run_dir: str, elastic: bool = False, none_yet: bool = False) -> str:
    """The command that continues a stopped run, for a run started with `run.resume = resume`.
    `elastic`: under torchrun with a --nnodes range, where a stop is also how the agents
    change the group's membership. `none_yet`: the run has no checkpoint to continue from, and
    a run dir that has trained starts over only when told (run/resume.py)."""
    if none_yet:
        return "run the same command with --reset to start over"
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
    saved: bool = True       # no rank has a checkpoint save still running (checkpoint/saver.py)
    trouble: bool = False    # rank 0's background work failed (Guard.exchange): all stop
    data_wait_s: float = 0.0  # the most any rank waited for its batch in the step
    ckpt_wait_s: float = 0.0  # ... and for checkpoints since the previous exchange


class Guard:
    """The exchange after each step, and what a bad step leads to: the update, a skipped step, a
    rollback (spike.py) or a stop."""

    def __init__(self, env: DistEnv, cfg: RunConfig, stop: StopSignal,
                 lr_fields: str = "optim.lr", checkpoints: Path | None = None, vocab: int = 0):
        """`lr_fields`: the learning rates to name in advice ("optim.lr or optim.muon_lr");
        `checkpoints`: the run's checkpoint directory, whose healthy ones a stop names;
        `vocab`: the data's vocabulary (ln V: a uniform guess's loss, which a run must not end
        above)."""
        self.env, self.cfg, self.signal, self.lr_fields = env, cfg, stop, lr_fields
        self.checkpoints = checkpoints
        self.skipped = 0  # steps skipped for a non-finite value in the run so far
        self.spikes = SpikePolicy(cfg, vocab)

    def exchange(self, loss: torch.Tensor, norm: torch.Tensor, scaled: bool,
                 saving: bool = False, waits: tuple[float, float] = (0.0, 0.0),
                 trouble: bool = False) -> Health:
        """The one collective of a step. `scaled`: fp16 with a GradScaler, which skips steps
        whose gradients overflow by itself, so only the loss counts. `saving`: this rank's
        checkpoint save is still running in the background. `waits`: the seconds this rank's
        loop waited for its data and for checkpoints since the last exchange (the Health holds
        the max over ranks: a synchronous step waits for the slowest). `trouble`: rank 0 has a
        failure from its background work to report (the lease's renewal: every rank stops)."""
        finite = torch.isfinite(loss) & (torch.isfinite(norm) | scaled)
        flags = torch.tensor([float(self.signal.requested), float(saving), float(trouble),
                              *waits], device=loss.device)
        rows = collectives.all_gather(self.env, torch.cat([loss.float().view(1),
                                                          finite.float().view(1), flags])).cpu()
        # rows: (W, 7)
        bad = [r for r in range(self.env.world_size) if not rows[r, 1]]
        return Health(rows[:, 0].mean().item(), bad, bool(rows[:, 2].any()),
                      not bool(rows[:, 3].any()), bool(rows[:, 4].any()),
                      rows[:, 5].max().item(), rows[:, 6].max().item())

    def judge(self, step: int, health: Health, batch: int,
              probe: Callable[[int], float]) -> Verdict:
        """What step `step` (1-based), which read global batch `batch`, leads to: the same on
        every rank. A stop raises. `probe`: see SpikePolicy.recover."""
        spikes, cfg = self.spikes, self.cfg
        if not health.bad:
            spikes.seen(step, health.loss)
        if health.bad and cfg.on_nonfinite != "spike":
            self.on_nonfinite(step, health.bad)
            return Verdict("skip")
        if not health.bad and (cfg.on_spike == "none" or not spikes.troubled(health.loss)):
            return spikes.healthy(step, health.loss, batch)
        spike = Spike(step, health.loss, spikes.median, health.bad, spikes.bound())
        what = f"step {step}: {spike.describe(cfg.spike_ratio, len(spikes.losses))}"
        if cfg.on_spike != "recover":  # stop, or none with a non-finite value
            self._stop(what, f" (run.on_spike = {cfg.on_spike})",
                       "or use --run.on-spike recover", spikes.through or step)
        verdict = spikes.recover(spike, probe)
        if verdict.fields.get("cause") == "nonfinite":
            self._count_skip(what, spikes.through or step)
        return verdict

    def _stop(self, where: str, why: str, advice: str, first: int) -> None:
        """Every rank raises the same line; `first`: the first step of the trouble, whose
        previous checkpoint holds the update that caused it."""
        raise DistError(f"{where}; stopped before the optimizer step{why}. "
                        f"{self.healthy_checkpoint(first)}; lower {self.lr_fields} or raise "
                        f"optim.warmup_steps, {advice}", quiet=not self.env.is_main)

    def healthy_checkpoint(self, first: int, suspects: bool = True) -> str:
        """Which checkpoint to resume from after trouble that began at step `first`, as advice;
        `suspects`: and which one a plain rerun would resume from, if that is a later one."""
        steps = store.step_dirs(self.checkpoints) if self.checkpoints else []
        suspect = [p for s, p in steps if s >= first - 1] if suspects else []
        good = [p for s, p in steps if s <= first - 2]
        said = (f"The checkpoint {suspect[0]} was written after the trouble began (the update "
                f"before step {first} may be its cause), and a plain rerun would resume from it; "
                if suspect else "")
        advice = (f"the newest healthy checkpoint is {good[-1]}: to resume from it, run the same "
                  f"command with --resume {good[-1]}" if good else
                  "no checkpoint before it is known healthy: --reset starts over")
        return said + advice if said else advice[0].upper() + advice[1:]  # a new sentence

    def end(self, step: int) -> Verdict | None:
        """The run's verdict at its end (guard/verdict.py): None when healthy, else the event
        and the one line, with the steps that skipped their update and the checkpoint to go
        back to."""
        found = verdict.judge(self.spikes)
        if found is None:
            return None
        why, first, fields = found
        skipped = self.skipped_steps(step)
        # (the newest healthy checkpoint alone: keep-last-k keeps it, where later ones go)
        return Verdict("stop", event="unhealthy", fields={
            **fields, "skipped_steps": self.spikes.data_skips + self.skipped}, line=(
            f"step {step}: the run trained to its end but is not healthy: {why}. "
            f"{skipped[0].upper() + skipped[1:] + '. ' if skipped else ''}Its checkpoints are "
            f"not a trained model. {self.healthy_checkpoint(first, False)}, and lower "
            f"{self.lr_fields}"))

    def skipped_steps(self, step: int) -> str:
        """How many of the run's `step` steps skipped their update, and why, for the end of the
        run ("" for none): a healthy run says it too, as skipped steps are steps not trained."""
        data, nonfinite = self.spikes.data_skips, self.skipped
        if not data + nonfinite:
            return ""
        why = [f"{data} whose batch spiked: the data"] * bool(data) + \
            [f"{nonfinite} non-finite"] * bool(nonfinite)
        return (f"{data + nonfinite} of the run's {step} steps skipped their update "
                f"({'; '.join(why)})")

    def on_nonfinite(self, step: int, bad: list[int]) -> None:
        """Every rank takes the same branch: raise (stop) or count a skipped step."""
        where = f"step {step}: non-finite loss or gradient norm on rank {', '.join(map(str, bad))}"
        if self.cfg.on_nonfinite == "stop":
            self._stop(where, "", "or use --on-nonfinite skip", step)
        self._count_skip(where, step)
        if self.env.is_main:
            warn(f"{where}; skipped ({self.skipped} of at most {self.cfg.max_skipped})")

    def _count_skip(self, where: str, first: int) -> None:
        if self.skipped >= self.cfg.max_skipped:  # skipping already: more, or fewer bad steps
            self._stop(where, f" after {self.skipped} skipped steps (run.max_skipped)",
                       "or raise run.max_skipped", first)
        self.skipped += 1

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

    def state_dict(self) -> dict:
        return {"skipped": self.skipped, "spike": self.spikes.state_dict()}

    def load_state_dict(self, state: dict | None, spike: dict | None = None) -> None:
        """`None`: a fresh start. `spike`: where checkpoints before the spike policy joined the
        guard's state kept it (beside it, as "spike")."""
        state = state or {}
        self.skipped = int(state.get("skipped", 0))
        self.spikes.load_state_dict(state.get("spike", spike))


def preempted(step: int, signal_name: str, checkpoint_dir, hint: str, quiet: bool) -> Preempted:
    return Preempted(f"at step {step} on {signal_name or 'a signal to another rank'}; "
                     f"checkpoint {checkpoint_dir} is complete: {hint}", quiet=quiet)


def collective_failed(error: CollectiveError, env: DistEnv, during: str,
                      timeout_s: float) -> DistError:
    """The one line for a collective that failed `during` ("step 7", "the checkpoint of step
    6"): this rank lost a peer."""
    return DistError(f"{during}: a collective failed on rank {env.rank} ({error}); "
                     f"another rank stalled or died (see its log). Collectives wait at most "
                     f"run.dist_timeout_s = {timeout_s:g} s")

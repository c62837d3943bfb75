"""Loss spikes: told apart by their cause, and survived without ever doing worse than training on.

A step is a spike when its global loss (the mean of every rank's: the same number on every rank)
is above `run.spike_ratio` × the median of the last `run.spike_window` healthy steps, or when
some rank's loss or gradient norm is not finite (with `run.on_nonfinite = spike`, the default).
It is found in the health exchange, before the optimizer step. `run.on_spike` says what follows:

    recover  (default) find the cause, then act on it.
             The data: the weights still do as well on the last healthy global batch as before
             (a probe: one forward over it, each rank its share, all-reduced: the same windows at
             any W). The step's update, whose gradient comes from the bad batch, is skipped, and
             the run goes on with the next batch. When `run.spike_patience` batches in a row
             have spiked so and the next one does too, the data itself has changed (a new
             domain: unshuffled data, a data switch): the run trains on it from there, and the
             window of healthy losses starts over at the new level (an event `shift`).
             The weights: the probe spikes too, so the update before the spike did the damage. The
             model trains on through it, exactly as with `none`: a transient heals within a few
             steps (an event says so). If it has not healed after `run.spike_patience` steps, or
             a value is not finite, every rank rolls back to the newest checkpoint known healthy
             (one whose next step was healthy, so never the one written just before the spike,
             which holds the update that caused it; keep-last-k never deletes the newest of
             them), skips the global batches read since, and trains on at
             `run.rollback_lr_factor` × the learning rate for the rest of the run (compounding
             with earlier rollbacks). A rollback to the checkpoint the previous one went to goes
             one further back. Once `run.max_rollbacks` rollbacks within `run.rollback_window`
             steps have not helped, the run trains on through the next spike instead, saying so
             (a non-finite step is skipped, counted against `run.max_skipped`).
    stop     every rank stops before the update, naming the newest healthy checkpoint and the
             command that resumes from it
    none     finite spikes pass (a non-finite value still stops the run)

Why. Measured on runs that spike (docs/reliability.md): a rollback at every spike turned a
transient that heals in two steps into a dead run, because the checkpoint it went back to already
held the damage, and skipping data cures nothing when the weights are the cause. Training through
a weight spike is what `none` does, so `recover` can only differ from it where the model fails to
heal (and then a rollback at a lower lr saves the run) or where the data is the cause (and then
skipping the batch is strictly better than learning from it).

Reproducible. The window of healthy losses, the spike being trained through, the lr factor and
the rollbacks are state saved in every checkpoint; the probe reads a batch by its global index;
a rollback reloads a checkpoint exactly as a restart does. The same command gives the same losses
at any W, and a run resumed after any of these goes on bitwise as if it had not stopped. Every
action is a metrics.jsonl event row and one line on rank 0.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from ddpgpt.config.schema import RunConfig


@dataclass
class Spike:
    """A step whose loss spiked, as every rank saw it."""

    step: int                  # the step (1-based)
    loss: float                # its global loss (inf or nan when not finite)
    median: float              # the recent median it was compared with (nan: too few steps yet)
    ranks: list[int] = field(default_factory=list)  # ranks with a non-finite value, if any

    def describe(self, ratio: float, window: int) -> str:
        if self.ranks:
            return ("non-finite loss or gradient norm on rank "
                    f"{', '.join(map(str, self.ranks))}")
        return (f"loss spike: {self.loss:.4g} is above {ratio:g} × the median "
                f"{self.median:.4g} of the last {window} steps")


@dataclass
class Verdict:
    """What a step leads to, the same on every rank."""

    action: str                        # "update", "skip" or "rollback"
    spike: Spike | None = None
    event: str | None = None           # the metrics.jsonl event to write, if any
    fields: dict = field(default_factory=dict)
    line: str = ""                     # the one line rank 0 prints
    first: int = 0                     # a rollback: the first step of the spike (its cause)


UPDATE = Verdict("update")
HEALTHY_KEPT = 8  # the known-healthy checkpoints remembered (a rollback goes back one or two)


class SpikePolicy:
    """The recent healthy losses and what the run has done about spikes: all of it state."""

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.losses: deque[float] = deque(maxlen=cfg.spike_window)
        self.through = 0        # the first step of a spike the model is training through (0: none)
        self.probe_batch = -1   # the global batch of the newest healthy step (the probe reads it)
        self.skips = 0          # steps skipped in a row as bad data
        self.lr_factor = 1.0    # on every later step's lr: rollback_lr_factor per rollback
        self.rollbacks: list[dict] = []  # {"step": spike's, "to": checkpoint's, "batches": n}
        # The checkpoints known healthy (their next step was healthy), newest last; None: a
        # checkpoint from before they were tracked, where any written 2 steps before a spike is.
        self.healthy_checkpoints: list[int] | None = []

    # ---- detection ------------------------------------------------------------------------------

    @property
    def median(self) -> float:
        return statistics.median(self.losses) if self.losses else math.nan

    def outlier(self, loss: float) -> bool:
        """Above the ratio × the median of a full window (never before it is full)."""
        return len(self.losses) == self.losses.maxlen and not loss <= self.cfg.spike_ratio * \
            self.median

    def confirm(self, checkpoint_step: int) -> None:
        """The step after checkpoint `checkpoint_step` was healthy: it is a rollback target."""
        known = self.healthy_checkpoints or []
        if checkpoint_step not in known:
            self.healthy_checkpoints = [*known, checkpoint_step][-HEALTHY_KEPT:]

    @property
    def newest_healthy(self) -> int | None:
        """The newest checkpoint known healthy (kept from pruning), if any."""
        return self.healthy_checkpoints[-1] if self.healthy_checkpoints else None

    def healthy(self, step: int, loss: float, batch: int) -> Verdict:
        """A step that is no spike: its loss joins the window; a spike trained through ends."""
        self.losses.append(loss)
        self.probe_batch, self.skips = batch, 0
        if not self.through:
            return UPDATE
        first, self.through = self.through, 0
        return Verdict("update", event="recovered", fields={"spike_step": first},
                       line=f"step {step}: the loss is back under {self.cfg.spike_ratio:g} × the "
                            f"median after the spike at step {first}, trained through "
                            f"({step - first} step{'s' * (step - first != 1)})")

    # ---- run.on_spike = recover -----------------------------------------------------------------

    def recover(self, spike: Spike, probe: Callable[[int], float]) -> Verdict:
        """`probe(batch)`: the global loss of the current weights on global batch `batch`
        (collective: every rank calls this with the same spike, so every rank probes)."""
        cfg, step = self.cfg, spike.step
        what = spike.describe(cfg.spike_ratio, len(self.losses))
        if not self.through:
            probed = probe(self.probe_batch) if self.probe_batch >= 0 else math.inf
            data = math.isfinite(probed) and probed <= cfg.spike_ratio * self.median
            if data and self.skips < cfg.spike_patience:
                self.skips += 1
                return Verdict("skip", spike, "skip", {"cause": "data", "probe_loss": probed},
                               f"step {step}: {what}; the weights still give {probed:.4g} on the "
                               "last healthy batch, so the data is the cause: this step's update "
                               "is skipped")
            if data and not spike.ranks:
                return self._shift(spike, probed, what)
            # A spike on every batch for spike_patience steps is no longer the data's doing,
            # whatever the probe's one batch says: it is handled as the weights' from the first.
            self.through = step - self.skips if data else step
            if not data and not spike.ranks:
                return Verdict("update", spike, "spike", {"cause": "weights",
                                                          "probe_loss": json_number(probed)},
                               f"step {step}: {what}; the weights give {probed:.4g} on the last "
                               "healthy batch too: training on through it (up to "
                               f"{cfg.spike_patience} steps before a rollback)")
        elif not spike.ranks and step - self.through < cfg.spike_patience:
            return Verdict("update", spike)  # still healing: the event said so at its start
        first = self.through
        if self.recent(step) < cfg.max_rollbacks:
            self.through = 0
            return Verdict("rollback", spike, first=first)
        # Rollbacks have not helped: train on as `none` would (a non-finite step cannot be).
        self.through = 0 if spike.ranks else self.through
        why = (f"{self.recent(step)} rollbacks within {cfg.rollback_window} steps have not "
               f"helped (run.max_rollbacks = {cfg.max_rollbacks})")
        if spike.ranks:
            return Verdict("skip", spike, "skip", {"cause": "nonfinite", "why": why},
                           f"step {step}: {what}; {why}: this step's update is skipped")
        if step - first == cfg.spike_patience:
            return Verdict("update", spike, "give_up", {"why": why},
                           f"step {step}: {what}; {why}: training on through it", first=first)
        return Verdict("update", spike)

    def _shift(self, spike: Spike, probed: float, what: str) -> Verdict:
        """spike_patience batches in a row, and this one, spiked while the weights stayed fine
        on the last healthy batch: no single batch is bad, the data has changed. Skipping more
        would skip the new data for good, and rolling back would meet it again: the run trains
        on it, and the median starts over from this step's loss."""
        skipped, step = self.skips, spike.step
        self.skips = 0
        self.losses.clear()
        self.losses.append(spike.loss)
        return Verdict("update", spike, "shift", {"cause": "data", "probe_loss": probed,
                                                  "skipped": skipped},
                       f"step {step}: {what}; {skipped + 1} global batches in a row spiked while "
                       f"the weights still give {probed:.4g} on the last healthy batch: the data "
                       f"itself has changed, so the run trains on it from here (the {skipped} "
                       "skipped before it stay skipped) and the median starts over")

    def rolled_back(self, spike_step: int, to: int, batches: int) -> None:
        self.rollbacks.append({"step": spike_step, "to": to, "batches": batches})
        self.lr_factor *= self.cfg.rollback_lr_factor

    def recent(self, step: int) -> int:
        """Rollbacks within run.rollback_window steps before `step`."""
        return sum(r["step"] > step - self.cfg.rollback_window for r in self.rollbacks)

    # ---- state ----------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        return {"losses": list(self.losses), "through": self.through, "skips": self.skips,
                "probe_batch": self.probe_batch, "lr_factor": self.lr_factor,
                "rollbacks": [dict(r) for r in self.rollbacks],
                "healthy_checkpoints": self.healthy_checkpoints}

    def load_state_dict(self, state: dict | None) -> None:
        """`None`: a fresh start, or a checkpoint from before spikes were tracked. A checkpoint
        of the earlier policy (a temporary lr cut, `lr_until`) keeps its window and rollbacks."""
        state = state or {}
        self.losses.clear()
        self.losses.extend(float(x) for x in state.get("losses", []))
        self.through = int(state.get("through", 0))
        self.skips = int(state.get("skips", 0))
        self.probe_batch = int(state.get("probe_batch", -1))
        self.lr_factor = float(state.get("lr_factor", 1.0))
        self.rollbacks = [dict(r) for r in state.get("rollbacks", [])]
        known = state.get("healthy_checkpoints", [] if not state else None)  # absent: older
        self.healthy_checkpoints = None if known is None else [int(s) for s in known]


def target(steps: list[int], first: int, origin: int, rollbacks: list[dict],
           known: list[int] | None = None) -> int | None:
    """The checkpoint step to roll back to for a spike whose first step is `first`, among the
    run's complete checkpoints `steps` (ascending) and its starting point `origin` (None: from
    this process's start, which is itself no checkpoint of this run). Healthy: known so (`known`:
    their next step was healthy; None, for a run resumed from a checkpoint that did not track
    them: any), and written at most at step first - 2, since the one of step first - 1 holds the
    update that caused the spike. One further back when the previous rollback went to the same
    one and it spiked again."""
    healthy = [s for s in steps if origin <= s <= first - 2 and (known is None or s in known)]
    if rollbacks and healthy and healthy[-1] == rollbacks[-1]["to"] and len(healthy) > 1:
        return healthy[-2]
    return healthy[-1] if healthy else None


def json_number(x: float) -> float | str:
    """JSON has no nan or inf: those are written as strings."""
    return x if math.isfinite(x) else str(x)

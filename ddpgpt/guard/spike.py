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
             The weights: the probe does not give about that batch's own loss (at most
             RECOVER_RATIO × it), so the update before the spike did the damage. The
             model trains on through it, exactly as with `none`: a transient heals within a few
             steps (an event says so: recovered, once a step's loss is back near the median
             before the spike, at most RECOVER_RATIO × it and never above ln V; merely under the
             spike ratio is not back). If it has not healed after `run.spike_patience` steps, or
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

The end. A run that trains to its end is judged on what the policy kept (guard/verdict.py):
the trouble of a spike, the last steps' losses, the lowest median, the val losses, the first
loss. Other data (a resume on another dataset or with other mixture weights, a shift) starts
those anew: the new data's losses are compared with the new data's alone.

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
    bound: float = 0.0         # a step of a spike still trained through, under the ratio but
                               # above this: not back yet (SpikePolicy.bound)

    def describe(self, ratio: float, window: int) -> str:
        if self.ranks:
            return ("non-finite loss or gradient norm on rank "
                    f"{', '.join(map(str, self.ranks))}")
        if self.bound and self.loss <= ratio * self.median:
            return (f"the loss {self.loss:.4g} is not back near the median {self.median:.4g} "
                    f"before the spike: above {self.bound:.4g}")
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
# Recovered: a step's loss back at most this × the median of the healthy steps before the
# spike began (and not above ln V, where the run had been below it). Under spike_ratio × it is
# not enough: a run that heals to 1.5 × its level has not healed. Healthy steps of the tiny
# runs in docs/reliability.md were at most 1.32-1.4 × their window's median, and at least half
# of them under it, so a healed run gets a step under 1.1 × within a few steps.
RECOVER_RATIO = 1.1


class SpikePolicy:
    """The recent healthy losses and what the run has done about spikes, and what the run's
    verdict at its end compares (guard/verdict.py): all of it state."""

    def __init__(self, cfg: RunConfig, vocab: int = 0):
        """`vocab`: the data's vocabulary V; ln V is what a uniform guess scores (0: unknown)."""
        self.cfg = cfg
        self.uniform = math.log(vocab) if vocab > 1 else math.inf
        self.losses: deque[float] = deque(maxlen=cfg.spike_window)
        self.lately: deque[float] = deque(maxlen=cfg.spike_window)  # every step's, spikes too
        self.best: list[float] = [math.inf, 0]  # the lowest median of the window, and its step
        self.val = [math.inf, math.inf, 0]  # the lowest val loss, the newest, the lowest's step
        self.first: list[float] = [math.inf, 0]  # the first loss (where training started from:
        # about ln V for untrained weights, or the new data's after anew), and its step
        # Trouble: a spike the weights caused, from its first step until the loss is back near
        # the median before it (spike.RECOVER_RATIO): {"step", "median", "val"} (val: the newest
        # val loss before it). A rollback carries it: the run it rolls back to must get back.
        self.trouble: dict | None = None
        self.through = 0        # the first step of a spike the model is training through (0: none)
        self.probe_batch = -1   # the global batch of the newest healthy step (the probe reads it)
        self.skips = 0          # steps skipped in a row as bad data
        self.data_skips = 0     # steps skipped as bad data in the run so far
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

    def bound(self) -> float:
        """The loss a step must be at or under for the trouble to be over: RECOVER_RATIO × the
        median before it, and never above ln V where that median was below it (0: no trouble)."""
        if self.trouble is None:
            return 0.0
        median = float(self.trouble["median"])
        return min(RECOVER_RATIO * median, self.uniform) if median < self.uniform \
            else RECOVER_RATIO * median

    def troubled(self, loss: float) -> bool:
        """A spike: an outlier, or a step of a spike still trained through that is not back
        under the bound (it does not join the window, and its patience runs on)."""
        return self.outlier(loss) or (bool(self.through) and not loss <= self.bound())

    def seen(self, step: int, loss: float) -> None:
        """Every finite step's loss, spikes included: the end's verdict reads the last ones, and
        the first."""
        self.lately.append(loss)
        if not math.isfinite(self.first[0]):
            self.first = [loss, step]

    def evaluated(self, step: int, val_loss: float) -> None:
        low, at = (val_loss, step) if val_loss < self.val[0] else (self.val[0], self.val[2])
        self.val = [low, val_loss, at]

    def anew(self, step: int = 0, loss: float | None = None) -> None:
        """Other data from here on: a resume on another dataset (data.allow_switch) or with other
        mixture weights (Trainer.restore), or a shift. Losses measured on the old data are no
        baseline for the new: the window, the lowest median, the val losses, the first loss, the
        probe's batch and a spike's trouble start over (from `loss`, the new data's first, at
        `step`: a shift's). The rollbacks, the lr factor and the checkpoints known healthy stay:
        they are the weights' history, not the data's."""
        self.losses.clear()
        self.lately.clear()
        self.best, self.val, self.first = [math.inf, step], [math.inf, math.inf, 0], [math.inf, 0]
        self.trouble, self.through, self.skips, self.probe_batch = None, 0, 0, -1
        if loss is not None:
            self.losses.append(loss)
            self.seen(step, loss)

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
        """A step that is no spike: its loss joins the window; trouble whose bound it is under
        is over (a spike trained through, or the history a rollback went back to)."""
        self.losses.append(loss)
        self.probe_batch, self.skips = batch, 0
        if len(self.losses) == self.losses.maxlen and self.median < self.best[0]:
            self.best = [self.median, step]
        # Back near the level before, at the step the trouble began or later: a rollback's first
        # steps are its checkpoint's healthy ones, and say nothing of the steps that broke.
        if self.trouble is None or step < self.trouble["step"] or not loss <= self.bound():
            return UPDATE
        first, median, bound = self.trouble["step"], float(self.trouble["median"]), self.bound()
        how = (f"trained through ({step - first} step{'s' * (step - first != 1)})" if self.through
               else f"after {len(self.rollbacks)} rollback{'s' * (len(self.rollbacks) != 1)}")
        self.through, self.trouble = 0, None
        return Verdict("update", event="recovered", fields={
            "spike_step": first, "loss_now": loss, "median": json_number(median),
            "bound": json_number(bound)},
            line=f"step {step}: recovered: the loss {loss:.4g} is back near the median "
                 f"{median:.4g} before the spike at step {first} (at most {bound:.4g}), {how}")

    # ---- run.on_spike = recover -----------------------------------------------------------------

    def recover(self, spike: Spike, probe: Callable[[int], float]) -> Verdict:
        """`probe(batch)`: the global loss of the current weights on global batch `batch`
        (collective: every rank calls this with the same spike, so every rank probes)."""
        cfg, step = self.cfg, spike.step
        what = spike.describe(cfg.spike_ratio, len(self.losses))
        if not self.through:
            probed = probe(self.probe_batch) if self.probe_batch >= 0 else math.inf
            # The data: the weights still do on that batch about as well as when it was trained
            # on (its loss is the window's newest). Merely under the spike ratio is not enough:
            # weights broken to 1.9 × the median would pass, their spikes be skipped as bad
            # data, and then taken for a new domain that resets the median at the broken level.
            data = math.isfinite(probed) and probed <= min(
                RECOVER_RATIO * self.losses[-1], cfg.spike_ratio * self.median)
            if data and self.skips < cfg.spike_patience:
                self.skips += 1
                self.data_skips += 1
                return Verdict("skip", spike, "skip", {"cause": "data", "probe_loss": probed},
                               f"step {step}: {what}; the weights still give {probed:.4g} on the "
                               "last healthy batch, so the data is the cause: this step's update "
                               "is skipped")
            if data and not spike.ranks:
                return self._shift(spike, probed, what)
            # A spike on every batch for spike_patience steps is no longer the data's doing,
            # whatever the probe's one batch says: it is handled as the weights' from the first.
            self.through = step - self.skips if data else step
            if self.trouble is None:  # the level to get back to (kept through rollbacks; no
                # healthy step yet: any finite loss is back)
                median = self.median if self.losses else math.inf
                self.trouble = {"step": self.through, "median": json_number(median),
                                "val": json_number(self.val[1])}
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
        on it, and what it is compared with starts over from this step's loss (anew)."""
        skipped, step = self.skips, spike.step
        self.anew(step, spike.loss)  # the new data's level is not the old one's
        return Verdict("update", spike, "shift", {"cause": "data", "probe_loss": probed,
                                                  "skipped": skipped},
                       f"step {step}: {what}; {skipped + 1} global batches in a row spiked while "
                       f"the weights still give {probed:.4g} on the last healthy batch: the data "
                       f"itself has changed, so the run trains on it from here (the {skipped} "
                       "skipped before it stay skipped), and the median and the lowest losses its "
                       "end is judged by start over")

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
                "healthy_checkpoints": self.healthy_checkpoints,
                "lately": list(self.lately), "best": list(self.best), "val": list(self.val),
                "first": list(self.first), "data_skips": self.data_skips,
                "trouble": dict(self.trouble) if self.trouble else None}

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
        # Absent before the end's verdict: a trouble a checkpoint was written in is unknown.
        self.lately.clear()
        self.lately.extend(float(x) for x in state.get("lately", []))
        self.best = [float(x) for x in state.get("best", [math.inf, 0])]
        self.val = [float(x) for x in state.get("val", [math.inf, math.inf])]
        self.val += [0.0] * (3 - len(self.val))  # the lowest's step: unknown before it was kept
        self.first = [float(x) for x in state.get("first", [math.inf, 0])]
        self.data_skips = int(state.get("data_skips", 0))
        self.trouble = dict(state["trouble"]) if state.get("trouble") else None
        if self.through and self.trouble is None:  # through a spike, saved by an older version
            self.trouble = {"step": self.through, "median": self.median, "val": "inf"}


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

"""The run's verdict at its end: healthy, or not (Guard.end: an event `unhealthy`, one line and
exit 3, so that no one takes its checkpoints for a trained model).

A run that trains to its end is unhealthy if

- a spike's trouble never ended: trained through, given up on, or rolled back to a history that
  never got back near the level before it (spike.RECOVER_RATIO × the median before it);
- it ends worse than uniform: its loss (the median of its last steps, spikes included) or its
  last val loss above ln V, where the run had been below it; or above both ln V and
  RECOVER_RATIO × the loss it started from, where it never was (it diverged from its start,
  and the spike window, filled after the divergence, never saw a spike). The margin: untrained
  weights score about ln V, a little above or below it from batch to batch, and a short run at
  a tiny lr ends there without having diverged;
- its loss rose: the median above spike_ratio × the lowest it had been (the training loss goes
  with the data read, and a harder stretch of unshuffled data raises it), or the last val loss
  above RECOVER_RATIO × its lowest (the same text each time: the weights got worse, a slow
  drift that no single step shows as a spike).

What it is compared with is the policy's (spike.SpikePolicy): other data (a resume on another
dataset or with other mixture weights, a shift) starts it anew.
"""

from __future__ import annotations

import math
import statistics

from ddpgpt.guard.spike import RECOVER_RATIO, SpikePolicy, json_number


def judge(policy: SpikePolicy) -> tuple[str, int, dict] | None:
    """None when healthy, else (why, the step the trouble began: the checkpoint two steps before
    it is the one to go back to, the event's fields)."""
    if not policy.lately:
        return None
    level, n = statistics.median(policy.lately), len(policy.lately)
    now = f"the median of its last {n} steps is {level:.4g}"
    val = f"; val_loss {policy.val[1]:.4g}" if math.isfinite(policy.val[1]) else ""
    # (named apart from a training row's loss and an evaluation's val_loss: readers of
    # metrics.jsonl tell rows by those)
    fields = {"loss_median": level, "steps": n, "last_val_loss": json_number(policy.val[1])}
    if policy.trouble is None:
        return _levels(policy, level, now, val, fields)
    t, bound = policy.trouble, policy.bound()
    before = f" against {float(t['val']):.4g} before it" if val and \
        math.isfinite(float(t["val"])) else ""
    return (f"its loss never came back near where it was before the spike at step "
            f"{t['step']}: {now}, above {bound:.4g} ({RECOVER_RATIO:g} × the "
            f"median {float(t['median']):.4g} before it){val}{before}", int(t["step"]),
            {**fields, "why": "not recovered", "spike_step": t["step"],
             "median": t["median"], "bound": json_number(bound), "val_before": t["val"]})


def _levels(policy: SpikePolicy, level: float, now: str, val: str,
            fields: dict) -> tuple[str, int, dict] | None:
    """Worse than uniform, or risen (the module's docstring); None: neither."""
    (best, at), (first, began) = policy.best, policy.first
    low, newest, low_at = policy.val
    uniform, ratio = policy.uniform, policy.cfg.spike_ratio
    bar = max(uniform, RECOVER_RATIO * first)
    below = best < uniform < level or low < uniform < newest
    if below or level > bar or math.isfinite(newest) and newest > bar:
        since = "" if below else (f", and above {RECOVER_RATIO:g} × the loss {first:.4g} it "
                                  f"started from at step {began:g}: it diverged from its start")
        return (f"it ends worse than uniform: {now}{val}, above ln V = {uniform:.4g}, what a "
                f"uniform guess over the vocabulary scores{since}",
                int(at) if below else int(began) + 1,
                {**fields, "why": "worse than uniform", "uniform": uniform,
                 "first_loss": json_number(first), "first_step": int(began)})
    fields = {**fields, "why": "rose", "best": json_number(best), "best_step": int(at),
              "best_val_loss": json_number(low), "best_val_step": int(low_at)}
    if level > ratio * best:
        lowest = f"; val_loss {low:.4g}" if val else ""
        return (f"its loss rose: {now}{val}, above {ratio:g} × the lowest it had been (the "
                f"median {best:.4g} at step {at:g}{lowest})", int(at), fields)
    if newest > RECOVER_RATIO * low:  # the checkpoint of its lowest val loss is the one to keep
        return (f"its val loss rose: {newest:.4g} at the end, above {RECOVER_RATIO:g} × its "
                f"lowest {low:.4g} (step {low_at:g}) on the same val text: the weights got "
                f"worse ({now})", int(low_at) + 2, fields)
    return None

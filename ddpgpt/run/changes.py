"""What a resume changes of the config its checkpoint was saved with (`changes`), and what the
changed-settings line adds to say what the changes mean: the lr the next steps take (`lr_note`:
a schedule that has ended, one started anew) and the spike guard starting anew on other data
(`data_note`). train.py says the line once the run has restored its checkpoint."""

from __future__ import annotations

import dataclasses
import math

from ddpgpt.config.io import START_FIELDS
from ddpgpt.config.optim import OptimConfig
from ddpgpt.config.schema import TrainConfig
from ddpgpt.optim.schedule import lr_at

# Settings that are not the training's: the first-start rule, and threads (may differ per node).
NOT_TRAINING = {f"{section}.{name}" for section, names in START_FIELDS.items() for name in names} \
    | {"run.dir"}  # a run gone on in another directory (its checkpoints at a URL) trains the same


def changes(saved: dict, cfg: TrainConfig) -> dict[str, list]:
    """{"optim.muon_lr": [old, new], ...}: every setting of `cfg` that differs from the config a
    checkpoint was saved with (`saved`, its meta.json's). Fields the checkpoint's version did not
    have yet are not changes."""
    out = {}
    for section, fields in cfg.to_dict().items():
        for name, value in fields.items():
            key = f"{section}.{name}"
            old = saved.get(section, {}).get(name, value)
            if key == "optim.min_lr":  # unset, a tenth of optim.lr: the floor each one is
                old, value = _floor(saved.get("optim", {}), cfg.optim), cfg.optim.floor
                old = value if math.isclose(old, value, rel_tol=1e-9) else old
            if key not in NOT_TRAINING and old != value:
                out[key] = [old, value]
    return out


def _floor(saved: dict, mine: OptimConfig) -> float:
    """A saved optim section's floor: its min_lr, or a tenth of its lr where unset."""
    if "min_lr" not in saved:
        return mine.floor
    return saved.get("lr", mine.lr) / 10 if saved["min_lr"] is None else saved["min_lr"]


# What decides a step's lr (optim/schedule.py): a change to any of them is followed, in the line
# that announces it, by the lr it gives.
LR_FIELDS = {"optim.lr", "optim.min_lr", "optim.muon_lr", "optim.schedule", "optim.warmup_steps",
             "optim.decay_steps", "optim.schedule_start", "optim.decay_fraction", "run.steps"}


def lr_note(cfg: TrainConfig, step: int, factor: float, changed: dict) -> str:
    """For the changed-settings line of a resume at `step` (`cfg` settled, `factor` the spike
    guard's rollback factor): the lr the next step takes; on a schedule that has ended (every
    later step at optim.min_lr, whatever optim.lr says), the flag that trains the new steps on
    a schedule of their own, and the lrs it gives; on a schedule started anew, its course. ""
    when nothing that decides the lr changed."""
    steps = cfg.run.steps
    if not LR_FIELDS & set(changed) or step >= steps:
        return ""
    optim = cfg.optim

    def at(o, index: int) -> float:  # the lr of step index + 1 (lr_at counts from 0)
        return lr_at(index, o, steps) * factor

    def course(o) -> str:  # where the steps after this one go: the warmup's end, the floor
        end, peak = o.decay_steps or steps, o.schedule_start + o.warmup_steps
        points = [f"{at(o, peak - 1):.3g} at step {peak} after its warmup"
                  ] if step + 1 < peak < end else []
        if o.schedule != "constant":
            points.append(f"{at(o, end - 1):.3g} at step {end}")
        return ", ".join(points)

    muon = f", muon_lr {at(optim, step) / optim.lr * optim.muon_lr:.3g}" \
        if optim.name == "muon" else ""
    note = f"; from step {step + 1}: lr {at(optim, step):.3g}{muon}"
    end = optim.decay_steps or steps
    if optim.schedule != "constant" and step >= end:
        anew = dataclasses.replace(optim, schedule_start=step, decay_steps=steps)
        return (f"{note}, optim.min_lr, to step {steps}: the schedule ended at step {end}; "
                f"--optim.schedule-start {step} trains steps {step + 1}-{steps} on a "
                f"{optim.schedule} of their own: lr {at(anew, step):.3g} at step {step + 1}, "
                f"{course(anew)}")
    if "optim.schedule_start" in changed and course(optim):
        note += f", on a {optim.schedule} of its own: {course(optim)}"
    return note


def data_note(cfg: TrainConfig, other_data: bool) -> str:
    """For the changed-settings line of a resume on other data than the checkpoint's (another
    dataset, with data.allow_switch, or other mixture weights): the loss spike guard starts anew
    there (Trainer.restore: SpikePolicy.anew), its window and the end's verdict from the new
    data's losses alone; "" on the same data."""
    if not other_data:
        return ""
    return ("; on the new data, loss spikes and the run's health are judged against its own "
            f"losses alone (none is looked for before {cfg.run.spike_window} steps of them)")

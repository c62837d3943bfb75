"""A step saved again, whose swap into place was cut short (a kill, the server gone): found,
loaded and put back in place, so that a start goes on from that step by its own name.

A re-save is written beside the step's checkpoint and swapped in once complete (store._publish):
locally by two renames (the previous copy to `.old-step_N-PID`, the new one from
`.tmp-step_N-PID`), in object storage by unpublishing the previous copy (meta.json first) and
copying the new one in (meta.json last). Cut between those steps, the step has no complete
`step_N/` but a complete copy beside it, which store.listed_steps lists as the step's
checkpoint (a start plans from it like any other). Under the run's lock the start puts it in
place (`repair`: the previous copy renamed back; in object storage the new one moved in, as
the swap would have), says so in one line naming the step, and loads it from `step_N/`
(`in_place`). An explicit --resume of that step_N/ reads the copy standing for it (`standing`).
"""

from __future__ import annotations

from pathlib import Path

from ddpgpt.checkpoint import location, store
from ddpgpt.files import move


def _copy_of(path) -> int | None:
    """The step whose swap copy `path` is (store.RESAVE's or store.ASIDE's name), or None."""
    found = store.RESAVE.match(path.name) or store.ASIDE.match(path.name)
    return int(found.group(1)) if found else None


def repair(root) -> list[str]:
    """Rank 0, under the run's lock, before the temporaries go: each step whose checkpoint is a
    swap's copy gets it back in place as step_N/. Returns a line for each."""
    root, lines = location.at(root), []
    for step, path in store.listed_steps(root) if _exists(root) else []:
        if _copy_of(path) is None:
            continue
        final = store.step_dir(root, step)
        if location.is_remote(root):  # the new copy is complete: the swap finished
            location.delete_checkpoint(final, "")  # what is left of the previous one
            location.move(path, final)
            which = "the new copy, complete,"
        else:  # the previous copy, as the re-save's failure would have left it
            move(path, final)
            which = "the previous copy"
        lines.append(f"ddpgpt: note: checkpoint {final}: saving step {step} again was cut short "
                     f"while swapping the new copy in; {which} is back in place, and this start "
                     "goes on from it")
    return lines


def _exists(root) -> bool:
    return location.is_remote(root) or Path(root).is_dir()


def in_place(path):
    """Where `path` is once `repair` has run: a swap's copy is its step's step_N/. A copy still
    standing (in a directory this start did not repair: --resume of another run's step) is read
    where it is."""
    step = None if path is None else _copy_of(path)
    if step is None or (path / "meta.json").is_file():
        return path
    return store.step_dir(path.parent, step)


def standing(path):
    """A step_N/ path (--resume PATH) without a complete checkpoint of its own: the swap copy
    that stands for it beside it, if there is one; else `path` as it is."""
    if not store.STEP_DIR.match(path.name) or (path / "meta.json").is_file():
        return path
    step = int(path.name.split("_")[1])
    listed = dict(store.listed_steps(path.parent)) if _exists(path.parent) else {}
    return listed.get(step, path)

"""Checkpoints: a store of the training's state plus the resolved config. Atomic publication,
validated load, the latest complete checkpoint, keep-last-k.

    checkpoints/step_0000100/                    format 3
        __0_0.distcp ... __{W-1}_0.distcp   each rank's share of the tensors (torch.distributed.
                                            checkpoint, one file per rank: sharded.py)
        .metadata                           DCP's index: which chunk of which tensor is where
        trainer.pt                          the small rest: optimizer hyperparameters and step
                                            counts, loader cursor, progress, skipped steps, loss
                                            scaler; torch.load(weights_only=True)
        meta.json                           written last: format version, step, each file's
                                            sha256, versions, the time, world size, and what the
                                            caller describes the checkpoint with (config, ...)

Every rank writes its files into `.tmp-step_NNNNNNN-TOKEN/` (fsynced); rank 0 then writes
trainer.pt and, last, meta.json with every file's sha256, fsyncs the directory and renames it to
`step_NNNNNNN`: a checkpoint exists complete or not at all (saver.py runs this across ranks,
`save` below on one process). A write that fails (a full disk) removes the temporary directory
and raises one line naming the reason. Loading checks every file's sha256 first; when the newest
checkpoint is partial or corrupt, `find_latest` falls back to the previous complete one with a
warning that names what was wrong. Deleting renames a checkpoint away first, so a reader never
sees one half deleted; keep-last-k also keeps the one checkpoint the caller names as the newest
known healthy (a loss spike's rollback target). A rollback after a loss spike supersedes the
checkpoints written after its target in one durable write (`record_rollback`, below), so that no
restart can go on from the history it abandoned. A step saved again is replaced so that it
always has a complete copy, even through a kill (`_publish`, swap.py). Formats 1 and 2
(model.safetensors + trainer.pt, written whole by rank 0) still load.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import time
from pathlib import Path

import torch

from ddpgpt import __version__
from ddpgpt.checkpoint import location
from ddpgpt.errors import UserError, warn
from ddpgpt.files import (
    WriteError,
    describe,
    os_error_in,
    publish_dir,
)

FORMAT_VERSION = 3
STEP_DIR = re.compile(r"^step_(\d{7,})$")
TEMPORARY = (".tmp-step_*", ".old-step_*", ".del-step_*")
RESAVE = re.compile(r"^\.tmp-step_(\d{7,})-")  # a step saved again in object storage, until swapped
ASIDE = re.compile(r"^\.old-step_(\d{7,})-")  # a local step's previous copy, while swapped
ROLLBACK = "rollback.json"  # a rollback decided, until a checkpoint of the history it goes on with


class CheckpointError(UserError):
    """A checkpoint that is incomplete, corrupt, or from an incompatible version."""


class CheckpointVersionError(CheckpointError):
    """A checkpoint format newer than this code: never skipped over, since older ones would lose
    the newer run's progress."""


class CheckpointGone(CheckpointError):
    """The checkpoint was deleted while being read (pruned by the run that is training)."""


def step_dir(root: Path, step: int) -> Path:
    return location.at(root) / f"step_{step:07d}"


def step_dirs(root: Path) -> list[tuple[int, Path]]:
    """(step, path) of every `step_NNNNNNN` directory in `root`, oldest first; complete or not;
    never one that a pending rollback has superseded (see record_rollback)."""
    root = location.at(root)
    found = listed_steps(root)
    record = pending_rollback(root, found) if found else None
    return found if record is None else [(s, p) for s, p in found if not _abandoned(s, p, record)]


def listed_steps(root: Path) -> list[tuple[int, Path]]:
    """(step, path) of every step directory in `root`, oldest first. A re-save of a step cut
    during its swap (`_publish`; swap.py puts it back) leaves step_NNNNNNN without meta.json, or
    none, and a complete copy beside it, which is then the step's checkpoint: in object storage
    the new one under its temporary prefix, locally the previous one renamed aside."""
    listed = location.children(root)
    found = {int(m.group(1)): p for p in listed if (m := STEP_DIR.match(p.name)) and p.is_dir()}
    copy = RESAVE if location.is_remote(root) else ASIDE
    resaved = [(int(m.group(1)), p) for p in listed
               if (m := copy.match(p.name)) and p.is_dir() and (p / "meta.json").is_file()]
    for step, tmp in resaved:
        if step not in found or not (found[step] / "meta.json").is_file():
            found[step] = tmp
    return sorted(found.items(), key=lambda f: f[0])


# ---- a rollback's decision ---------------------------------------------------------------------

def record_rollback(root: Path, record: dict) -> None:
    """Rank 0, when a run rolls back after a loss spike, before anything else changes: `record`
    ({"to": the target's step, "rollbacks": the run's count of rollbacks with this one, and what
    applying it again needs: run/resume.py}) written atomically and durably. From the moment it is
    on the disk, the checkpoints after "to" that the abandoned history wrote (their meta.json
    counts fewer rollbacks) are superseded: `step_dirs` and `find_latest` no longer list them, and
    a restart goes on from the target with the rollback applied. The first checkpoint of the new
    history spends the record (commit removes it)."""
    path = location.at(root) / ROLLBACK
    try:  # a rollback to the initial state: maybe no directory yet (replace_file makes it)
        location.replace_file(path, (json.dumps(record, indent=1) + "\n").encode())
    except (OSError, WriteError) as e:
        why = describe(e) if isinstance(e, OSError) else str(e)
        raise WriteError(f"cannot record the rollback in {path}: {why}; the run stops "
                         "before going on from a history a restart would not continue") from None


def pending_rollback(root: Path, found: list | None = None) -> dict | None:
    """The rollback recorded in `root` that no checkpoint of its new history has spent yet, or
    None. `found`: the step directories, when the caller has listed them."""
    path = location.at(root) / ROLLBACK
    try:
        record = json.loads(path.read_text())
        record["to"], record["rollbacks"] = int(record["to"]), int(record["rollbacks"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{path}: unreadable ({type(e).__name__}: {e}); it records a "
                              "rollback after a loss spike: move it away to resume from the "
                              "newest checkpoint instead") from None
    if found is None:
        found = listed_steps(location.at(root))
    spent = any(_rollbacks_in(p) >= record["rollbacks"] for _, p in found)
    return None if spent else record


def superseded(root: Path) -> list[Path]:
    """The checkpoints a pending rollback has superseded (to be moved out of the way)."""
    root = location.at(root)
    found = listed_steps(root)
    record = pending_rollback(root, found) if found else None
    if record is None:
        return []
    return [p for step, p in found if _abandoned(step, p, record)]


def _abandoned(step: int, path: Path, record: dict) -> bool:
    return step > record["to"] and _rollbacks_in(path) < record["rollbacks"]


def _rollbacks_in(path: Path) -> int:
    """The rollbacks a checkpoint's history had had (its meta.json; 0 when it does not say)."""
    try:
        return int(json.loads((path / "meta.json").read_text()).get("rollbacks", 0))
    except (OSError, ValueError, TypeError, AttributeError):
        return 0


def spend_rollback(root: Path, rollbacks: int) -> None:
    """A checkpoint whose history has had `rollbacks` rollbacks is published: the recorded
    rollback it descends from is applied in it, and its record goes."""
    path = location.at(root) / ROLLBACK
    try:
        if int(json.loads(path.read_text())["rollbacks"]) <= rollbacks:
            path.unlink()
    except (OSError, ValueError, KeyError, TypeError, UserError):
        pass  # pending_rollback sees it spent all the same


# ---- save ------------------------------------------------------------------------------------

def temporary(root: Path, step: int, token: str) -> Path:
    """Where checkpoint `step` is written before it is published; `token` (rank 0's PID) is the
    same on every rank and differs from any earlier run's. In object storage, its own prefix,
    published by its meta.json (location.py); unless that step is there complete already (saved
    again): then beside it, swapped in once complete (`_publish`). Every rank asks: no save is in
    flight, so all see the same."""
    root, final = location.at(root), step_dir(root, step)
    if location.is_remote(root) and not (final / "meta.json").is_file():
        return final
    return root / f".tmp-{final.name}-{token}"


def discard(tmp: Path, final: Path) -> None:
    """What a failed save wrote goes, unless it is a complete re-save in object storage whose
    swap was cut after the previous copy was unpublished: that one is now the step's checkpoint
    (listed_steps)."""
    if tmp != final and location.is_remote(tmp) and (tmp / "meta.json").is_file() \
            and not (final / "meta.json").is_file():
        return
    location.remove_tree(tmp)


def save(root: Path, step: int, state: dict, meta: dict, keep: int,
         protect: int | None = None) -> Path:
    """One process: writes checkpoint `step` of `state` ({"model": weights, ...rest}) atomically
    and prunes to the newest `keep`. `meta` (JSON) describes it: what resuming needs to decide
    before loading. (A training saves through saver.Saver: every rank its share.)"""
    from ddpgpt.checkpoint import sharded  # DCP (~1 CPU s): here, not for a launcher's start
    root, final = location.at(root), step_dir(root, step)
    tmp = temporary(root, step, str(os.getpid()))
    rest = {k: v for k, v in state.items() if k != "model"}
    try:
        location.remove_tree(tmp)
        tensors = {f"model.{k}": sharded.whole(v.detach()) for k, v in state["model"].items()}
        writer = sharded.save(tensors, tmp, None)
        commit(tmp, final, hash_files(tmp, writer.files + [sharded.INDEX], writer.digests), rest,
               {"world_size": 1, **meta})
    except BaseException as e:
        discard(tmp, final)
        cause = os_error_in(e)
        if cause is None:
            raise
        raise WriteError(f"cannot write checkpoint {final}: {describe(cause)}; its temporary files "
                         "were removed") from None
    prune(root, keep, protect)
    return final


def hash_files(directory: Path, names: list[str], known: dict[str, str] | None = None
               ) -> dict[str, str]:
    """Each file's sha256: read back from a local directory; in object storage, as the writer
    hashed its bytes on their way out (`known`: sharded.Writer.digests), not downloaded again."""
    known = known if location.is_remote(directory) and known else {}
    return {name: known.get(name) or location.sha256(directory / name) for name in names}


def commit(tmp: Path, final: Path, files: dict[str, str], rest: dict, meta: dict) -> None:
    """The last part of a save, on one process once every rank's files are in `tmp` (fsynced,
    `files`: name -> sha256): trainer.pt (`rest`), then meta.json, both fsynced, the directory
    fsynced and renamed to `final`, its parent fsynced. OSError on failure; the caller removes
    `tmp`."""
    data = _torch_bytes(rest)
    location.write_file(tmp / "trainer.pt", data)
    files = {**files, "trainer.pt": hashlib.sha256(data).hexdigest()}
    there = location.listed(tmp)
    meta = {"format_version": FORMAT_VERSION, "step": int(final.name.split("_")[1]),
            "files": files, "sizes": {name: there.get(name, (None,))[0] for name in files},
            "ddpgpt_version": __version__, "torch_version": torch.__version__,
            "saved_at": time.time(), **meta}
    if location.is_remote(tmp):  # what a load compares: an object replaced gets another
        meta["etags"] = {name: there[name][1] for name in files if name in there}
    # last: it marks the checkpoint complete (and, in object storage, publishes it)
    location.write_file(tmp / "meta.json", (json.dumps(meta, indent=1) + "\n").encode())
    location.sync(tmp)
    _publish(tmp, final)
    spend_rollback(final.parent, int(meta.get("rollbacks", 0)))
    try:
        location.sync(final.parent)
    except OSError as e:  # published all the same: the rename is what counts
        warn(f"checkpoint {final} is written, but its directory could not be synced "
             f"({e.strerror}); it may not survive a power loss")


def _torch_bytes(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _publish(tmp: Path, final: Path) -> None:
    """The same step saved again (e.g. a resumed run's end) replaces it; if the new copy cannot
    take its place, the previous one stays the checkpoint. In object storage, one saved again
    beside the previous one (`temporary`) replaces it: the previous one unpublished (meta.json
    first), the new one copied in server-side (meta.json last). At every moment one of them is
    complete and listed: the previous one, the new one under its temporary prefix
    (listed_steps), then the new one in place."""
    if tmp == final:
        return
    if location.is_remote(final):
        location.delete_checkpoint(final, "")
        location.move(tmp, final)
        return
    publish_dir(tmp, final, aside=final.with_name(f".old-{final.name}-{os.getpid()}"))


def prune(root: Path, keep: int, protect: int | None = None) -> None:
    """Deletes all but the newest `keep` complete checkpoints (never the newest, which `save` has
    just written) and the one of step `protect` (the newest known healthy: a loss spike's
    rollback target). Each is renamed away before it is deleted. A failed delete is a warning,
    never a stop."""
    complete = [(s, p) for s, p in step_dirs(root) if (p / "meta.json").is_file()]
    for step, path in complete[:-keep]:
        if step == protect:
            continue
        try:
            location.delete_checkpoint(path, str(os.getpid()))
        except (OSError, UserError) as e:
            why = e.strerror if isinstance(e, OSError) else e
            warn(f"could not delete old checkpoint {path} ({why}); training goes on")


def remove_temporaries(root: Path) -> list[Path]:
    """Deletes what interrupted saves and deletes left behind (run at startup, under the run's
    lock, so no save is in progress), but a copy still standing for its step (a re-save whose
    swap was cut: swap.repair puts it back in place first). Returns what was removed."""
    root = location.at(root)
    if not (location.is_remote(root) or root.is_dir()):
        return []
    standing = {p for _, p in listed_steps(root)}
    if location.is_remote(root):  # prefixes an upload left without a meta.json, and re-saves
        leftovers = [p for p in root.iterdir() if p.is_dir() and (
            RESAVE.match(p.name) and p not in standing
            or STEP_DIR.match(p.name) and "meta.json" not in location.sizes(p))]
    else:
        leftovers = [p for pattern in TEMPORARY for p in root.glob(pattern) if p not in standing]
    for path in leftovers:
        location.remove_tree(path)
    return leftovers


# ---- load ------------------------------------------------------------------------------------

def read_meta(path: Path, verify: bool = True) -> dict:
    """A checkpoint's meta.json, validated: present, parseable, a format we read, and (`verify`)
    every file present with the sha256 meta.json lists (in object storage: with the size and
    ETag it lists, from one listing; the files read whole are checked on their bytes: read.py)."""
    path = location.at(path)
    meta_path = path / "meta.json"
    try:
        meta = json.loads(meta_path.read_text())
        version, files = int(meta["format_version"]), dict(meta["files"])
        int(meta["step"])
    except FileNotFoundError:
        if not path.exists():
            raise CheckpointGone(f"{path}: deleted while being read") from None
        raise CheckpointError(f"{path}: incomplete checkpoint (no meta.json)") from None
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{meta_path}: corrupt meta.json ({type(e).__name__}: {e})") from None
    if version > FORMAT_VERSION:
        raise CheckpointVersionError(f"{path}: checkpoint format version {version} is newer "
                                     f"than this ddpgpt reads ({FORMAT_VERSION}); upgrade ddpgpt "
                                     "(pip install -U ddpgpt)")
    if verify and location.is_remote(path) and meta.get("sizes"):
        _check_objects(path, meta)
        return meta
    for name, expected in files.items() if verify else ():
        try:
            actual = location.sha256(path / name)
        except FileNotFoundError:
            if not path.exists():
                raise CheckpointGone(f"{path}: deleted while being read") from None
            raise CheckpointError(f"{path}: {name} is missing") from None
        if actual != expected:
            raise CheckpointError(f"{path}: {name} does not match its sha256 in meta.json "
                                  "(corrupt)")
    return meta


def _check_objects(path, meta: dict) -> None:
    """Every object meta.json lists is there with its size and the ETag (or version) it had when
    the checkpoint was committed, from one listing: an object appears whole or not at all, so
    this finds a missing one, and a replaced one even of the same size."""
    there = location.listed(path)
    if not there:
        raise CheckpointGone(f"{path}: deleted while being read")
    tags = meta.get("etags") or {}
    for name, size in meta["sizes"].items():
        if name not in there:
            raise CheckpointError(f"{path}: {name} is missing")
        if size is not None and there[name][0] != size:
            raise CheckpointError(f"{path}: {name} has {there[name][0]} bytes, meta.json says "
                                  f"{size} (replaced or corrupt)")
        if tags.get(name) and there[name][1] != tags[name]:
            raise CheckpointError(f"{path}: {name} is not the object that was saved (its ETag is "
                                  f"{there[name][1] or 'none'}, meta.json says {tags[name]}: "
                                  "replaced since)")


def find_latest(root: Path, quiet: bool = False) -> tuple[Path, dict] | None:
    """The newest checkpoint in `root` that validates, falling back past bad ones with a warning
    each (unless `quiet`: another rank says it). When checkpoints exist but none validates, a
    CheckpointError names the newest's problem. `root` is named in messages by its run dir (its
    parent)."""
    problems = []
    for _, path in reversed(step_dirs(root)):
        try:
            meta = read_meta(path)
        except CheckpointVersionError:
            raise
        except CheckpointGone:
            continue
        except CheckpointError as e:
            problems.append(e)
            continue
        for e in problems if not quiet else ():
            warn(f"skipping checkpoint: {e}; falling back to {path.name}")
        return path, meta
    if problems:
        n = len(problems) - 1
        more = f" (and {n} older one{'s' if n > 1 else ''})" if n else ""
        raise CheckpointError(f"no valid checkpoint in {location.describe_where(root)}: "
                              f"{problems[0]}{more}; "
                              "move the bad ones away, or pass --reset to set them aside and "
                              "start over")
    return None

"""Checkpoints: a store of state dicts plus the resolved config. Atomic save, validated load, the
latest complete checkpoint, keep-last-k.

    checkpoints/step_0000100/
        model.safetensors   state["model"]: the single-device model's weights (safetensors:
                            no pickle)
        trainer.pt          the rest of the state (optimizer, loader cursor, progress, every rank's
                            RNG, ...), read back with torch.load(weights_only=True)
        meta.json           written last: format version, step, each file's sha256, versions, the
                            time, and what the caller describes the checkpoint with (config, ...)

The state is serialized in memory, then written into `.tmp-step_NNNNNNN-PID/`; every file and the
directory are fsynced, meta.json is written last, and the directory is renamed to `step_NNNNNNN`:
a checkpoint exists complete or not at all. A write that fails (a full disk) removes the
temporary directory and raises one line naming the reason. Loading reads each file once, checks
its sha256 and deserializes the same bytes; when the newest checkpoint is partial or corrupt,
`find_latest` falls back to the previous complete one with a warning that names what was wrong.
Deleting renames a checkpoint away first, so a reader never sees one half deleted.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import time
from pathlib import Path

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from ddpgpt import __version__
from ddpgpt.errors import UserError, warn
from ddpgpt.files import WriteError, describe, fsync, os_error_in, sha256, write_bytes

FORMAT_VERSION = 2
STEP_DIR = re.compile(r"^step_(\d{7,})$")
TEMPORARY = (".tmp-step_*", ".old-step_*", ".del-step_*")


class CheckpointError(UserError):
    """A checkpoint that is incomplete, corrupt, or from an incompatible version."""


class CheckpointVersionError(CheckpointError):
    """A checkpoint format newer than this code: never skipped over, since older ones would lose
    the newer run's progress."""


class CheckpointGone(CheckpointError):
    """The checkpoint was deleted while being read (pruned by the run that is training)."""


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step_{step:07d}"


def step_dirs(root: Path) -> list[tuple[int, Path]]:
    """(step, path) of every `step_NNNNNNN` directory in `root`, oldest first; complete or not."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir()
             if (m := STEP_DIR.match(p.name)) and p.is_dir()]
    return sorted(found)


# ---- save ------------------------------------------------------------------------------------

def save(root: Path, step: int, state: dict, meta: dict, keep: int) -> Path:
    """Writes checkpoint `step` of `state` ({"model": weights, ...rest}) atomically and prunes to
    the newest `keep`. `meta` (JSON) describes it: what resuming needs to decide before loading."""
    root, final = Path(root), step_dir(root, step)
    tmp = root / f".tmp-{final.name}-{os.getpid()}"
    files = {"model.safetensors": _weights_bytes(state["model"]),
             "trainer.pt": _torch_bytes({k: v for k, v in state.items() if k != "model"})}
    meta = {"format_version": FORMAT_VERSION, "step": step,
            "files": {name: hashlib.sha256(data).hexdigest() for name, data in files.items()},
            "ddpgpt_version": __version__, "torch_version": torch.__version__,
            "saved_at": time.time(), **meta}
    try:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        for name, data in files.items():
            write_bytes(tmp / name, data)
        write_bytes(tmp / "meta.json",
                    (json.dumps(meta, indent=1) + "\n").encode())  # last: complete
        fsync(tmp)
        _publish(tmp, final)
        fsync(root)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        cause = os_error_in(e)
        if cause is None:
            raise
        raise WriteError(f"cannot write checkpoint {final}: {describe(cause)}; its temporary files "
                         "were removed") from None
    prune(root, keep)
    return final


def _weights_bytes(weights: dict[str, torch.Tensor]) -> bytes:
    # A copy each: with zero1 the parameters are views of shared flat buffers, which
    # safetensors refuses to write as they are.
    return save_safetensors({k: v.detach().to("cpu", copy=True) for k, v in weights.items()})


def _torch_bytes(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _publish(tmp: Path, final: Path) -> None:
    if final.exists():  # the same step saved again (e.g. a resumed run's end): replace it
        old = final.with_name(f".old-{final.name}-{os.getpid()}")
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)


def prune(root: Path, keep: int) -> None:
    """Deletes all but the newest `keep` complete checkpoints (never the newest, which `save` has
    just written). Each is renamed away before it is deleted. A failed delete is a warning,
    never a stop."""
    complete = [p for _, p in step_dirs(root) if (p / "meta.json").is_file()]
    for path in complete[:-keep]:
        doomed = path.with_name(f".del-{path.name}-{os.getpid()}")
        try:
            os.rename(path, doomed)
            shutil.rmtree(doomed)
        except OSError as e:
            warn(f"could not delete old checkpoint {path} ({e.strerror}); training goes on")


def remove_temporaries(root: Path) -> list[Path]:
    """Deletes what interrupted saves and deletes left behind (run at startup, under the run's
    lock, so no save is in progress). Returns what was removed."""
    root = Path(root)
    leftovers = [p for pattern in TEMPORARY for p in root.glob(pattern)] if root.is_dir() else []
    for path in leftovers:
        shutil.rmtree(path, ignore_errors=True)
    return leftovers


# ---- load ------------------------------------------------------------------------------------

def read_meta(path: Path, verify: bool = True) -> dict:
    """A checkpoint's meta.json, validated: present, parseable, a format we read, and (`verify`)
    every file present with the sha256 meta.json lists."""
    meta_path = path / "meta.json"
    if not meta_path.is_file():
        if not path.exists():
            raise CheckpointGone(f"{path}: deleted while being read")
        raise CheckpointError(f"{path}: incomplete checkpoint (no meta.json)")
    try:
        meta = json.loads(meta_path.read_text())
        version, files = int(meta["format_version"]), dict(meta["files"])
        int(meta["step"])
    except FileNotFoundError:
        raise CheckpointGone(f"{path}: deleted while being read") from None
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{meta_path}: corrupt meta.json ({type(e).__name__}: {e})") from None
    if version > FORMAT_VERSION:
        raise CheckpointVersionError(f"{path}: checkpoint format version {version} is newer "
                                     f"than this ddpgpt reads ({FORMAT_VERSION}); upgrade ddpgpt "
                                     "(pip install -U ddpgpt)")
    for name, expected in files.items() if verify else ():
        try:
            actual = sha256(path / name)
        except FileNotFoundError:
            if not path.exists():
                raise CheckpointGone(f"{path}: deleted while being read") from None
            raise CheckpointError(f"{path}: {name} is missing") from None
        if actual != expected:
            raise CheckpointError(f"{path}: {name} does not match its sha256 in meta.json "
                                  "(corrupt)")
    return meta


def find_latest(root: Path) -> tuple[Path, dict] | None:
    """The newest checkpoint in `root` that validates, falling back past bad ones with a warning
    each. When checkpoints exist but none validates, a CheckpointError names the newest's
    problem. `root` is named in messages by its run dir (its parent)."""
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
        for e in problems:
            warn(f"skipping checkpoint: {e}; falling back to {path.name}")
        return path, meta
    if problems:
        n = len(problems) - 1
        more = f" (and {n} older one{'s' if n > 1 else ''})" if n else ""
        raise CheckpointError(f"no valid checkpoint in {Path(root).parent}: {problems[0]}{more}; "
                              "move the bad ones away, or pass --reset to set them aside and "
                              "start over")
    return None


def load(path: Path, meta: dict, weights_only: bool = False) -> dict:
    """The state saved at `path` ({"model": weights, ...}; only "model" with `weights_only`).
    Each file is read once; its sha256 is checked on the very bytes that are deserialized."""
    names = ["model.safetensors"] + ([] if weights_only else ["trainer.pt"])
    data = {}
    for name in names:
        try:
            data[name] = (path / name).read_bytes()
        except FileNotFoundError:
            raise CheckpointGone(f"{path}: deleted while being read") from None
        if hashlib.sha256(data[name]).hexdigest() != meta["files"][name]:
            raise CheckpointError(f"{path}: {name} does not match its sha256 in meta.json "
                                  "(corrupt)")
    state = {"model": load_safetensors(data["model.safetensors"])}
    if not weights_only:
        state.update(torch.load(io.BytesIO(data["trainer.pt"]), map_location="cpu",
                                weights_only=True))
        if meta["format_version"] == 1:
            _upgrade_v1(state, meta)
    return state


def _upgrade_v1(state: dict, meta: dict) -> None:
    """Format 1 kept the loader cursor and the progress counters in meta.json."""
    state["loader"] = meta["loader"]
    state["progress"] = {"step": int(meta["step"]), "elapsed_s": float(meta.get("elapsed_s", 0.0))}
    state["guard"] = {"skipped": int(meta.get("skipped_steps", 0))}


def load_weights(path: Path, model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Puts `weights` into `model`, or one line saying why they do not fit."""
    try:
        model.load_state_dict(weights)
    except RuntimeError as e:
        lines = str(e).splitlines()
        first = lines[1].strip() if len(lines) > 1 else str(e)
        raise CheckpointError(f"{path}: weights do not fit this model ({first})") from None


def load_latest(root: Path, weights_only: bool = True) -> tuple[Path, dict, dict] | None:
    """(path, meta, state) of the newest valid checkpoint in `root`, or None. A checkpoint pruned
    by a running training while it is read is skipped for the next newest. A directory listing
    taken while checkpoints are renamed can miss both the new one and the old one, so an empty
    listing of an existing directory is taken twice more before it counts as empty."""
    empty = 0
    for _ in range(20):
        found = find_latest(root)
        if found is None:
            empty += 1
            if empty == 3 or not Path(root).is_dir():
                return None
            time.sleep(0.05)
            continue
        try:
            return *found, load(*found, weights_only=weights_only)
        except CheckpointGone:
            continue
    raise CheckpointError(f"the checkpoints in {Path(root).parent} kept being deleted while read; "
                          "try again (is a run with run.keep_checkpoints = 1 saving very often?)")

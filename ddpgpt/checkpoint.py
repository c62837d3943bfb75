"""Checkpoints: atomic save, validated load, the latest complete checkpoint, keep-last-k.

    <run>/checkpoints/step_0000100/
        model.safetensors   the single-device model's weights (safetensors: no pickle)
        trainer.pt          optimizer state and every rank's RNG state (read with weights_only=True)
        meta.json           written last: format version, step, loader cursor, resolved config,
                            world size, and the sha256 of each file above

Rank 0 writes into `checkpoints/.tmp-step_NNNNNNN-PID/`, fsyncs every file and the directory,
writes meta.json, fsyncs again, and renames the directory to `step_NNNNNNN`: a checkpoint either
exists complete or not at all. Loading re-hashes each file against meta.json; when the newest
checkpoint is partial or corrupt, `find_latest` falls back to the previous complete one with a
warning that names what was wrong.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ddpgpt import __version__
from ddpgpt.data.shards import file_sha256
from ddpgpt.errors import UserError, warn
from ddpgpt.layering import from_dict

FORMAT_VERSION = 1
STEP_DIR = re.compile(r"^step_(\d{7,})$")


class CheckpointError(UserError):
    """A checkpoint that is incomplete, corrupt, or from an incompatible version."""


class CheckpointVersionError(CheckpointError):
    """A checkpoint format newer than this code: never skipped over, since older ones would lose
    the newer run's progress."""


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def checkpoints_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def step_dir(run_dir: str | Path, step: int) -> Path:
    return checkpoints_dir(run_dir) / f"step_{step:07d}"


def step_dirs(run_dir: str | Path) -> list[tuple[int, Path]]:
    """(step, path) of every `step_NNNNNNN` directory, oldest first; complete or not."""
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := STEP_DIR.match(p.name)) and p.is_dir()]
    return sorted(found)


def save(run_dir: str | Path, step: int, model: torch.nn.Module, trainer_state: dict, meta: dict,
         keep: int) -> Path:
    """Writes checkpoint `step` atomically (rank 0 only) and prunes to the newest `keep`."""
    final = step_dir(run_dir, step)
    root = final.parent
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    weights = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    save_file(weights, tmp / "model.safetensors")
    torch.save(trainer_state, tmp / "trainer.pt")
    files = {}
    for name in ("model.safetensors", "trainer.pt"):
        _fsync(tmp / name)
        files[name] = file_sha256(tmp / name)
    meta = {"format_version": FORMAT_VERSION, "step": step, "files": files,
            "ddpgpt_version": __version__, "torch_version": torch.__version__, **meta}
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    _fsync(tmp / "meta.json")
    _fsync(tmp)
    if final.exists():  # the same step saved again (e.g. a resumed run's end): replace it
        old = root / f".old-{final.name}-{os.getpid()}"
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)
    _fsync(root)
    prune(run_dir, keep)
    return final


def prune(run_dir: str | Path, keep: int) -> None:
    """Deletes all but the newest `keep` complete checkpoints (never the newest, which `save` has
    just written), and temporary directories left by saves that crashed. A failed delete is a
    warning, never a stop."""
    complete = [p for _, p in step_dirs(run_dir) if (p / "meta.json").is_file()]
    root = checkpoints_dir(run_dir)
    leftovers = [*root.glob(".tmp-step_*"), *root.glob(".old-step_*")]
    for path in complete[:-keep] + leftovers:
        try:
            shutil.rmtree(path)
        except OSError as e:
            warn(f"could not delete old checkpoint {path} ({e.strerror}); training goes on")


def read_meta(path: Path) -> dict:
    """A checkpoint's meta.json, validated: present, parseable, a format we read, files intact."""
    meta_path = path / "meta.json"
    if not meta_path.is_file():
        raise CheckpointError(f"{path}: incomplete checkpoint (no meta.json)")
    try:
        meta = json.loads(meta_path.read_text())
        version, files = int(meta["format_version"]), dict(meta["files"])
        int(meta["step"])
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{meta_path}: corrupt meta.json ({type(e).__name__}: {e})") from None
    if version > FORMAT_VERSION:
        raise CheckpointVersionError(f"{path}: checkpoint format version {version} is newer than this ddpgpt "
                              f"reads ({FORMAT_VERSION}); upgrade ddpgpt (pip install -U ddpgpt)")
    for name, expected in files.items():
        if not (path / name).is_file():
            raise CheckpointError(f"{path}: {name} is missing")
        if file_sha256(path / name) != expected:
            raise CheckpointError(f"{path}: {name} does not match its sha256 in meta.json (corrupt)")
    return meta


def find_latest(run_dir: str | Path) -> tuple[Path, dict] | None:
    """The newest checkpoint that validates, falling back past bad ones with a warning each.
    When checkpoints exist but none validates, a CheckpointError names the newest's problem."""
    problems = []
    for _, path in reversed(step_dirs(run_dir)):
        try:
            meta = read_meta(path)
        except CheckpointVersionError:
            raise
        except CheckpointError as e:
            problems.append(e)
            continue
        for e in problems:
            warn(f"skipping checkpoint: {e}; falling back to {path.name}")
        return path, meta
    if problems:
        more = f" (and {len(problems) - 1} older one{'s' if len(problems) > 2 else ''})" if len(problems) > 1 else ""
        raise CheckpointError(f"no valid checkpoint in {run_dir}: {problems[0]}{more}; move the bad ones "
                              "away, or pass --reset to set them aside and start over")
    return None


def load_trainer_state(path: Path) -> dict:
    return torch.load(path / "trainer.pt", map_location="cpu", weights_only=True)


def load_weights(path: Path, model: torch.nn.Module) -> None:
    state = load_file(path / "model.safetensors")
    try:
        model.load_state_dict(state)
    except RuntimeError as e:
        lines = str(e).splitlines()
        first = lines[1].strip() if len(lines) > 1 else str(e)
        raise CheckpointError(f"{path}: weights do not fit this model ({first})") from None


def latest_for_inference(run_dir: str | Path):
    """(path, meta, the resolved TrainConfig) of a run's newest valid checkpoint, for eval and
    sample; a run without one is a one-line error."""
    found = find_latest(run_dir)
    if found is None:
        raise UserError(f"run {run_dir} has no complete checkpoint; train first (ddpgpt train --run-dir {run_dir})")
    path, meta = found
    return path, meta, from_dict(meta["config"], source=f"{path / 'meta.json'}")

"""Reading checkpoints: a checkpoint's state whole on this process, validated (every file's
sha256 checked on the bytes deserialized), whatever format, mode and world size wrote it; and a
run's model from its checkpoint directory, in one place: `eval`, `sample` and `export` (and
anything else that wants trained weights) ask here for the newest complete checkpoint, or one
step's, and for the model it holds. The store's layout and writing are store.py's."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save_file as save_safetensors_file

from ddpgpt.checkpoint import location
from ddpgpt.checkpoint.store import (
    CheckpointError,
    CheckpointGone,
    find_latest,
    read_meta,
    step_dir,
    step_dirs,
)
from ddpgpt.config.io import from_dict
from ddpgpt.config.schema import TrainConfig
from ddpgpt.data.mixture import MixedDataset
from ddpgpt.data.shards import TokenDataset
from ddpgpt.data.tokenizer import fingerprint
from ddpgpt.errors import UserError, beside
from ddpgpt.files import as_created, describe, os_error_in

if TYPE_CHECKING:  # the model (dynamo, through flex) is imported where one is built
    from ddpgpt.model.gpt import GPT


def load(path: Path, meta: dict, weights_only: bool = False) -> dict:
    """The state saved at `path`, whole, on this process ({"model": weights, ...}; only "model"
    with `weights_only`), in the layout Trainer.load_state_dict reads whatever mode and W saved
    it. A training resumes a format-3 checkpoint sharded instead (Trainer.restore): each rank
    reads only what it holds. Formats 1-2: each file is read once; its sha256 is checked on the
    very bytes that are deserialized. Format 3: so are the index and trainer.pt; the tensors' files
    are read by DCP, after read_meta(verify=True) checked them (find_latest does)."""
    if int(meta["format_version"]) >= 3:
        return _load_sharded(path, meta, weights_only)
    names = ["model.safetensors"] + ([] if weights_only else ["trainer.pt"])
    data = {name: read_verified(path, meta, name) for name in names}
    state = {"model": load_safetensors(data["model.safetensors"])}
    if not weights_only:
        state.update(torch.load(io.BytesIO(data["trainer.pt"]), map_location="cpu",
                                weights_only=True))
        if meta["format_version"] == 1:
            _upgrade_v1(state, meta)
    return state


def read_verified(path: Path, meta: dict, name: str) -> bytes:
    """The bytes of one of the checkpoint's files, once, checked against meta.json's sha256."""
    try:
        data = (path / name).read_bytes()
    except FileNotFoundError:
        raise CheckpointGone(f"{path}: deleted while being read") from None
    if hashlib.sha256(data).hexdigest() != meta["files"].get(name):
        raise CheckpointError(f"{path}: {name} does not match its sha256 in meta.json (corrupt)")
    return data


def open_sharded(path: Path, meta: dict, rest: bool = True):
    """(DCP's index, the rest from trainer.pt or None) of a format-3 checkpoint, each read once
    and checked on those bytes; the index is unpickled with DCP's own classes only."""
    from ddpgpt.checkpoint import sharded  # DCP: where a checkpoint is read (see store.save)

    data = read_verified(path, meta, sharded.INDEX)
    try:
        index = sharded.parse_index(data)
    except Exception as e:  # its sha256 matched: written by something else than ddpgpt
        raise CheckpointError(f"{path}: {sharded.INDEX} is not an index of tensors "
                              f"({type(e).__name__}: {e})") from None
    if not rest:
        return index, None
    return index, torch.load(io.BytesIO(read_verified(path, meta, "trainer.pt")),
                             map_location="cpu", weights_only=True)


def read_tensors(path: Path, index, prefix: str) -> dict[str, torch.Tensor]:
    """Every tensor whose name starts with `prefix`, whole (sharded.read_whole)."""
    from ddpgpt.checkpoint import sharded

    with _reading(path):
        return sharded.read_whole(path, index, prefix)


def read_into(path: Path, index, targets: dict) -> None:
    """The chunks `targets` (sharded.Pieces) ask for, in place, on this process alone."""
    from ddpgpt.checkpoint import sharded

    with _reading(path):
        sharded.load(targets, path, index, None)


@contextlib.contextmanager
def _reading(path: Path):
    """DCP's failures as one line: a checkpoint pruned while read is CheckpointGone."""
    try:
        yield
    except BaseException as e:
        from ddpgpt.checkpoint import sharded

        first = sharded.failures(e)[0][1]
        cause = os_error_in(first)
        if isinstance(cause, FileNotFoundError) and not path.exists():
            raise CheckpointGone(f"{path}: deleted while being read") from None
        if cause is not None:
            raise CheckpointError(f"{path}: cannot read its tensors: {describe(cause)}") from None
        if isinstance(first, UserError):
            raise first from None
        raise


def _load_sharded(path: Path, meta: dict, weights_only: bool) -> dict:
    index, rest = open_sharded(path, meta, rest=not weights_only)
    if weights_only:
        return {"model": read_tensors(path, index, "model.")}
    tensors = read_tensors(path, index, "")
    state = dict(rest)
    state["model"] = {k[6:]: v for k, v in tensors.items() if k.startswith("model.")}
    rng = {k[4:]: v for k, v in tensors.items() if k.startswith("rng.")}
    if rng:
        state["rng"] = rng
    if "param_groups" in state.get("optimizer", {}).get("adamw", {}):  # a training's
        saved = {kind: _torch_layout(kind, part, tensors)
                 for kind, part in state["optimizer"].items()}
        state["optimizer"] = saved if "muon" in saved else saved["adamw"]
    return state


def _torch_layout(kind: str, part: dict, tensors: dict[str, torch.Tensor]) -> dict:
    """torch's optimizer state_dict over the whole model (parameters numbered in group order)
    from a format-3 checkpoint's tensors (by name) and hyperparameters."""
    names = [n for group in part["param_groups"] for n in group["params"]]
    state = {}
    for i, name in enumerate(names):
        slots = {key.rsplit(".", 1)[1]: t for key, t in tensors.items()
                 if key.startswith(f"optimizer.{kind}.{name}.")}
        if slots:
            if kind == "adamw":
                slots["step"] = torch.tensor(float(part["step"][name]))
            state[i] = slots
    groups, start = [], 0
    for group in part["param_groups"]:
        n = len(group["params"])
        groups.append({**group, "params": list(range(start, start + n))})
        start += n
    return {"state": state, "param_groups": groups}


def weights(path: Path, meta: dict | None = None) -> dict[str, torch.Tensor]:
    """The model's weights, whole, on this process (any format): what an export writes out."""
    meta = meta or read_meta(path)
    return load(path, meta, weights_only=True)["model"]


def export_safetensors(path: Path, out: Path) -> Path:
    """The checkpoint's weights as one consolidated safetensors file (names as the single-device
    model's state_dict), for tools that read one file."""
    save_safetensors_file({k: v.contiguous() for k, v in weights(path).items()}, str(out))
    as_created(out)
    return Path(out)


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
            if empty == 3 or not location.at(root).is_dir():
                return None
            time.sleep(0.05)
            continue
        try:
            return *found, load(*found, weights_only=weights_only)
        except CheckpointGone:
            continue
    raise CheckpointError(f"the checkpoints in {location.describe_where(location.at(root))} kept "
                          "being deleted while read; "
                          "try again (is a run with run.keep_checkpoints = 1 saving very often?)")


def newest_meta(root) -> tuple[dict, str] | None:
    """(the meta.json, where it was read) of the newest complete checkpoint at `root` (a run's
    checkpoints, or their URL), or None when there is none: what a start on another machine
    goes on with (train --run-dir NEW --run.checkpoint-url URL): its config, and the number of
    processes that saved it."""
    found = find_latest(location.at(root))
    return (found[1], str(found[0] / "meta.json")) if found else None


@dataclass
class RunCheckpoint:
    """One checkpoint of a run: where it is, its meta.json, the config it was trained with, and
    its weights (whole, on the CPU)."""
    path: Path
    meta: dict
    config: TrainConfig
    weights: dict[str, torch.Tensor]

    @property
    def step(self) -> int:
        return int(self.meta["step"])


def run_checkpoint(run_dir, step: int = 0) -> RunCheckpoint:
    """`run_dir` (a RunDir)'s newest complete checkpoint, or that of `step`; one line when there
    is none."""
    if step:
        path = step_dir(run_dir.checkpoints, step)
        if not path.is_dir():
            have = [s for s, _ in step_dirs(run_dir.checkpoints)]
            listed = ", ".join(map(str, have)) if have else "none"
            raise UserError(f"run {run_dir} has no checkpoint at step {step} (it has: {listed}); "
                            "give one of those, or leave --step out for the newest")
        meta = read_meta(path)
        found = path, meta, load(path, meta, weights_only=True)
    else:
        found = load_latest(run_dir.checkpoints)
        if found is None:
            near = ""
            if not Path(str(run_dir)).exists():
                near = beside(str(run_dir), "checkpoints", "runs")
            raise UserError(f"run {run_dir} has no complete checkpoint{near}; train first "
                            f"(ddpgpt train --run-dir {run_dir})")
    path, meta, state = found
    return RunCheckpoint(path, meta, from_dict(meta["config"], source=str(path / "meta.json")),
                 state["model"])


def trained_tokenizer(path: Path, meta: dict) -> str | None:
    """The tokenizer fingerprint (data.tokenizer.fingerprint) the checkpoint at `path` was
    trained with: recorded in its meta.json, or, for checkpoints from before that was recorded,
    read from its run dir's copy of the tokenizer (data_meta.json, tokenizer.json). None when
    neither says."""
    if meta.get("tokenizer_fingerprint"):
        return meta["tokenizer_fingerprint"]
    if location.is_remote(path):  # written since it is recorded
        return None
    run = Path(path).parent.parent
    try:
        kind = json.loads((run / "data_meta.json").read_text())["tokenizer"]
        return fingerprint(kind, run)
    except (OSError, ValueError, KeyError, TypeError, UserError):
        return None


def check_data(found: RunCheckpoint, dataset: TokenDataset | MixedDataset, data_dir: str,
               given: bool, run: str) -> None:
    """Data to evaluate `found` (of run dir `run`) on (`data_dir`: its data.dir) must be what it
    was trained on (meta.json's data_fingerprint, as a resume checks), unless `given` (--data:
    other data on purpose); and always under its tokenizer, whose ids are what the model learned
    (another's would score noise, or index past the model's vocabulary). One line otherwise."""
    where = f"checkpoint {found.path}"
    trained = trained_tokenizer(found.path, found.meta)
    mine = dataset.tokenizer_fingerprint
    if (trained is not None and trained != mine) or \
            dataset.vocab_size > found.config.model.vocab_size:
        was = trained.split(":")[0] if trained else f"{found.config.model.vocab_size} ids"
        raise UserError(f"{where} was trained with another tokenizer ({was}) than the one of "
                        f"{data_dir} ({mine.split(':')[0]}, {dataset.vocab_size} ids): its ids "
                        "would mean other text; evaluate on data prepared with the run's "
                        f"tokenizer (ddpgpt prepare SOURCES --tokenizer-from {run} --out DIR, "
                        "then --data DIR)")
    saved = found.meta.get("data_fingerprint")
    if not given and saved is not None and saved != dataset.fingerprint:
        raise UserError(f"{where} was trained on other data (fingerprint {saved[:12]}) than "
                        f"{data_dir} holds now ({dataset.fingerprint[:12]}): it was replaced or "
                        f"prepared again since; pass --data {data_dir} to evaluate on it anyway")


def model_of(found: RunCheckpoint, device: torch.device | str) -> GPT:
    """The model a checkpoint holds, on `device`, in eval mode. Its attention is `device`'s
    (model.attention auto): the weights do not depend on it, and the run's own choice was made
    for the device it trained on."""
    from ddpgpt.model.gpt import GPT  # the model (and dynamo, through flex): not for a launcher

    model = GPT(dataclasses.replace(found.config.model, attention="auto")).to(device)
    load_weights(found.path, model, found.weights)
    return model.eval()


def load_model(run_dir, device: torch.device | str, step: int = 0) -> tuple[GPT, RunCheckpoint]:
    """The model of `run_dir`'s newest checkpoint (or `step`'s) on `device`, in eval mode."""
    found = run_checkpoint(run_dir, step)
    return model_of(found, device), found

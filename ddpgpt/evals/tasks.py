"""Task files: a jsonl with one example per line, read by its kind's line parser (kinds.py). A
multiple-choice file (the default kind) holds `{"ctx": str, "endings": [str, ...], "label": int}`
on each line (HellaSwag's shape; PIQA, ARC or a user's own set converted to it);
multiple_choice.example reads one. A bundle of tasks (a kind with a reader: `--task core
--task-data DIR`, evals/bundle.py) is a directory read whole by its kind's reader; its examples
are its tasks.

HellaSwag's validation set is downloaded once into a cache (DDPGPT_CACHE_DIR, else
~/.cache/ddpgpt) from the HellaSwag repository at a fixed commit and checked against its content
hash before use. The hash is git's blob id of the file (a SHA-1 over "blob SIZE\\0" and the
bytes: the id GitHub lists for it in that commit), so it is checked against the publisher's own
record rather than against a copy someone once downloaded. Offline, the error names the URL and
--task-data.

A bad file is one line naming FILE:LINE and what is wrong there; nothing is scored from it.
"""

from __future__ import annotations

import hashlib
import os
import re
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from ddpgpt.errors import DataError, UserError
from ddpgpt.evals import kinds
from ddpgpt.evals.kinds import DEFAULT, KINDS
from ddpgpt.files import atomic_write

HELLASWAG = "hellaswag"
HELLASWAG_COMMIT = "a29ff8e9a04bba4bd6588223785ce105328adc57"
HELLASWAG_URL = ("https://raw.githubusercontent.com/rowanz/hellaswag/"
                 f"{HELLASWAG_COMMIT}/data/hellaswag_val.jsonl")
HELLASWAG_BLOB = "0f5ee25d72216f12317d5d8a7b92deafa423d81e"  # git ls-tree of that commit
NAME = re.compile(r"[a-z][a-z0-9_]*")


@dataclass(frozen=True)
class Task:
    name: str
    source: str  # the file the examples came from
    examples: tuple  # of its kind's examples (multiple choice: Example)
    kind: str = DEFAULT  # its row in kinds.KINDS


def check_name(name: str, flag: str) -> None:
    """A task name makes metric keys (NAME_acc_norm): lower-case letters, digits and _."""
    if not NAME.fullmatch(name):
        raise UserError(f"{flag}: task name {name!r} must be lower-case letters, digits and _, "
                        "starting with a letter (it names the metrics: NAME_acc_norm, ...)")


def pairs(names: str, files: str, flag: str, data_flag: str) -> list[tuple[str, str]]:
    """(task, file) for each comma-separated task ([KIND:]NAME), with its file from the
    comma-separated `files` in the same order ('' for hellaswag: the cached download). One file
    may be given for one task."""
    tasks = [n.strip() for n in names.split(",") if n.strip()]
    given = [f.strip() for f in files.split(",")] if files else []
    if given and len(given) != len(tasks):
        raise UserError(f"{data_flag} names {len(given)} file(s) for the {len(tasks)} task(s) of "
                        f"{flag}; give one per task, in order (empty for hellaswag's download)")
    out, seen = [], set()
    for i, spec in enumerate(tasks):
        kind, name = kinds.split(spec, flag)
        check_name(name, flag)
        path = given[i] if given else ""
        if not path and KINDS[kind].read:
            raise UserError(f"{flag} {spec}: give its {KINDS[kind].row} with {data_flag} DIR")
        if not path and (name != HELLASWAG or KINDS[kind].parse != KINDS[DEFAULT].parse):
            raise UserError(f"{flag} {spec}: only hellaswag downloads itself; give the task's "
                            f"jsonl (one {KINDS[kind].row} per line) with {data_flag} FILE")
        out.append((spec, path))
        seen.add(name)
    if len(seen) != len(out):
        raise UserError(f"{flag} {names}: a task is named twice")
    return out


def load(spec: str, path: str, limit: int = 0) -> Task:
    """The task's examples (the first `limit`, 0: all) from `path`, or from HellaSwag's cached
    download when `path` is empty. `spec`: [KIND:]NAME. A bundle's examples are its tasks, each
    capped at `limit` by its kind's reader."""
    kind, name = kinds.split(spec, "--task")
    if KINDS[kind].read:
        return Task(name, path, tuple(kinds.load(KINDS[kind].read)(Path(path), limit)), kind)
    file = Path(path) if path else hellaswag_file()
    return Task(name, str(file), tuple(read(file, limit, kind)), kind)


def load_all(names: str, files: str, limit: int, flag: str, data_flag: str,
             bundle_limit: int | None = None) -> list[Task]:
    """Every task named in `names` (comma-separated), each from its file in `files` (or
    HellaSwag's cached download), the first `limit` examples of each (0: all); a bundle's
    tasks `bundle_limit` each (None: `limit`)."""
    out = []
    for spec, path in pairs(names, files, flag, data_flag):
        bundle = KINDS[kinds.split(spec, flag)[0]].read
        out.append(load(spec, path, bundle_limit if bundle and bundle_limit is not None
                        else limit))
    return out


def for_run(run) -> list[Task]:
    """A training's tasks (run.eval_tasks, run.eval_task_data, run.eval_task_limit; a CORE
    bundle's tasks run.eval_core_limit each): read and checked before any worker or process
    group starts, and again by every worker."""
    return load_all(run.eval_tasks, run.eval_task_data, run.eval_task_limit, "run.eval_tasks",
                    "run.eval_task_data", run.eval_core_limit)


def read(path: Path, limit: int = 0, kind: str = DEFAULT) -> list:
    """Every example of a jsonl file, checked line by line by its kind's parser (multiple
    choice: multiple_choice.example)."""
    parse, row = kinds.load(KINDS[kind].parse), KINDS[kind].row
    try:
        lines = Path(path).read_bytes().splitlines()
    except FileNotFoundError:
        raise DataError(f"{path}: no such task file; give a jsonl with one {row} per "
                        "line") from None
    except OSError as e:
        raise DataError(f"{path}: cannot read it ({e.strerror or e})") from None
    out = []
    for number, raw in enumerate(lines, 1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DataError(f"{path}:{number}: not UTF-8 (byte 0x{raw[e.start]:02x} at column "
                            f"{e.start + 1}); save the file as UTF-8") from None
        if line.strip():
            out.append(parse(line, f"{path}:{number}"))
            if limit and len(out) == limit:
                break
    if not out:
        raise DataError(f"{path}: no examples; give a jsonl with one {row} per line")
    return out


# ---- HellaSwag's validation set, downloaded once -----------------------------------------------

def cache_dir() -> Path:
    return Path(os.environ.get("DDPGPT_CACHE_DIR") or Path.home() / ".cache" / "ddpgpt")


def blob_id(data: bytes) -> str:
    """git's id of a file's content: SHA-1 of b"blob SIZE\\0" + content."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def hellaswag_file() -> Path:
    """The cached validation jsonl, downloaded and checked first if it is not there yet."""
    path = cache_dir() / "hellaswag_val.jsonl"
    if path.is_file():
        if blob_id(path.read_bytes()) != HELLASWAG_BLOB:
            raise DataError(f"{path}: not HellaSwag's validation set (its content hash is not "
                            f"{HELLASWAG_BLOB}); delete it to download it again")
        return path
    try:
        with urllib.request.urlopen(HELLASWAG_URL, timeout=60) as response:
            data = response.read()
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", None) or e
        raise DataError(f"cannot download HellaSwag's validation set from {HELLASWAG_URL} "
                        f"({reason}); download that file where there is a network and give it "
                        "with --task-data FILE") from None
    if blob_id(data) != HELLASWAG_BLOB:
        raise DataError(f"{HELLASWAG_URL}: the download is not HellaSwag's validation set (its "
                        f"content hash is not {HELLASWAG_BLOB}); nothing was cached; try again, "
                        "or give the file with --task-data FILE")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_write(path) as f:  # whole or absent: concurrent ranks each rename a copy
            f.write(data)
    except OSError as e:
        raise UserError(f"{path.parent}: cannot cache HellaSwag there ({e.strerror}); set "
                        "DDPGPT_CACHE_DIR to a directory you can write to") from None
    return path

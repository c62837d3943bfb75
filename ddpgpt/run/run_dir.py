"""The one place that knows a run directory's layout, and the lock that gives it to one run.

    runs/NAME/
      .lock              held (flock) by the run training here; names its PID and host
      job.json           the launchers (elastic agents) of the job that trains here: a start is
                         the job's first unless one of its launchers is listed (elastic.py)
      config.json        the resolved config (no `auto` left); `--nproc` workers start from it
      configs.jsonl      each start's config and world size that differed from the one before,
                         with its step
      data_meta.json     the dataset's meta.json, and tokenizer.json (bpe): `sample` needs only
                         this dir; a mixture's first dataset's, and data_sources.json (each
                         source's name, dir, weight and fingerprint)
      metrics.jsonl      one row per logged step and per evaluation (see metrics.py)
      checkpoints/       step_NNNNNNN/ (see checkpoint/store.py); with run.checkpoint_url they
                         are at that URL instead (checkpoint/location.py), beside copies of
                         data_meta.json, tokenizer.json and the logs (logs.py), so that `eval`,
                         `sample`, `export` and `plot` of the URL need nothing local; job.json
                         is kept there too, where every node's launchers see it, and lease.json
                         while a job trains into it (checkpoint/lease.py: one job at a time)
      tensorboard/, wandb/, tracker.json    run.tracker's files (see trackers.py)
      reset-<time>/      what --reset set aside; rewind-<time>/ what --resume PATH set aside
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import time
from pathlib import Path

from ddpgpt.checkpoint import location
from ddpgpt.checkpoint.lease import Lease
from ddpgpt.data import storage
from ddpgpt.errors import UserError, beside, say
from ddpgpt.files import WriteError, describe, move, path_kind, replace_text
from ddpgpt.run import logs
from ddpgpt.run.lock import Lock, RunDirBusy  # noqa: F401  (RunDirBusy: where callers import it)


def check_local(path) -> None:
    """A training's run dir is local: a URL there is one line naming run.checkpoint_url."""
    if storage.is_url(str(path)):
        raise UserError(f"--run-dir {path}: a training's run dir is a local directory (its lock, "
                        "config and metrics); to keep its checkpoints at that URL, give --run-dir "
                        f"DIR --run.checkpoint-url {path}")


def check_continues(path: str) -> None:
    """`train --run-dir R` without --data (nor --preset, --config) continues the run in R: one
    line, with the run meant, when R holds none (a mistyped name would train a new run from the
    defaults)."""
    check_local(path)
    path = Path(path)
    if (path / "config.json").is_file():
        return
    there = "does not exist" if not path.exists() else "holds no run (no config.json)"
    raise UserError(f"run dir {path} {there}{beside(path, 'config.json', 'runs')}; to "
                    "continue a run, give its --run-dir; to start a new one there, give its "
                    "--data (and a --preset)")


class RunDir:
    """A run's directory. `checkpoint_url`: where its checkpoints are when they are not in its
    checkpoints/ (run.checkpoint_url; None: as its config.json says). `path` may itself be such a
    URL: the run as its checkpoints' location holds it, for eval, sample, export and plot."""

    def __init__(self, path: str | os.PathLike, checkpoint_url: str | None = None):
        self.path = location.at(path)
        if checkpoint_url is None:
            checkpoint_url = str(path) if location.is_remote(self.path) else self.saved_url()
        self.url = checkpoint_url or ""
        self._lock = Lock(self.path)  # used only where the run dir is local
        self.lease: Lease | None = None  # held while this start trains into self.url

    def saved_url(self) -> str:
        """run.checkpoint_url as config.json has it: where the run's checkpoints were ("":
        checkpoints/)."""
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError, AttributeError):
            return str(json.loads(self.config.read_text())["run"].get("checkpoint_url") or "")
        return ""

    def __str__(self) -> str:
        return str(self.path)

    @property
    def remote(self) -> location.Remote | None:
        """The checkpoints' location in object storage, or None (checkpoints/ here)."""
        return location.at(self.url) if self.url else None

    @property
    def job(self):
        return self.remote / "job.json" if self.remote else self.path / "job.json"

    @property
    def configs(self) -> Path:
        return self.path / "configs.jsonl"

    @property
    def config(self) -> Path:
        return self.path / "config.json"

    @property
    def metrics(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def checkpoints(self):
        """Where the checkpoints are: checkpoints/, or run.checkpoint_url's location."""
        return self.remote if self.remote else self.path / "checkpoints"

    @property
    def data_meta(self) -> Path:
        return self.path / "data_meta.json"

    def read_data_meta(self, needs: str) -> dict:
        """The run's data_meta.json (its dataset's meta.json: tokenizer, vocabulary), or one
        line saying that `needs` (who asks: "export needs") the run dir a training wrote."""
        try:
            meta = json.loads(self.data_meta.read_text())
            meta["tokenizer"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise UserError(f"run {self}: cannot read its data_meta.json ({e}); {needs} the run "
                            "dir a training wrote") from None
        return meta

    @property
    def tokenizer(self) -> Path:
        return self.path / "tokenizer.json"

    @property
    def tracker_files(self) -> list[Path]:
        """What run.tracker writes: TensorBoard's event files, W&B's files and its run id."""
        return [self.path / "tensorboard", self.path / "wandb", self.path / "tracker.json"]

    @property
    def lock_file(self) -> Path:
        return self._lock.file

    # ---- creating and locking ---------------------------------------------------------------

    def next_commands(self) -> str:
        """What a finished training is followed by: its loss, a sample, its curves, an export."""
        return (f"ddpgpt: next: ddpgpt eval --run-dir {self} | ddpgpt sample --run-dir {self} "
                f"--prompt TEXT | ddpgpt plot {self} | ddpgpt export --run-dir {self} --out DIR")

    def check_creatable(self) -> None:
        """Bad paths as one line, before anything is read or written (the data's hashes, the
        cache that remembers them): a file where the directory or one of its parents should be,
        or a place where mkdir fails — tried on the first missing directory, which is removed
        again, so that a refused run dir leaves nothing behind. Each path is looked at once
        (files.path_kind): another rank's probe may make and remove a directory between two
        looks. A URL is refused (check_local)."""
        check_local(self.path)
        for _ in range(3):  # a parent seen here may be another rank's probe, gone by mkdir
            if self._probe():
                return

    def _probe(self) -> bool:
        """check_creatable's one try: True when settled, False when a directory seen to be
        there was gone by the time of the mkdir under it (look again)."""
        kind = path_kind(self.path)
        if kind == "file":
            raise UserError(f"run dir {self.path} is a file; give a directory (--run-dir)")
        if kind == "dir":
            return True
        first, parent = self.path, self.path.parent
        while (kind := path_kind(parent)) == "missing":
            first, parent = parent, parent.parent
        if kind == "file":
            raise UserError(f"run dir {self.path}: {parent} is a file, not a directory; "
                            "give another --run-dir")
        try:
            first.mkdir()
        except FileExistsError:  # made meanwhile (another rank): create() will see
            return True
        except OSError as e:
            if isinstance(e, FileNotFoundError) and path_kind(parent) == "missing":
                return False
            raise UserError(f"run dir {self.path}: cannot create it: {describe(e)}; give a "
                            "writable --run-dir") from None
        with contextlib.suppress(OSError):  # another rank may have filled it meanwhile
            first.rmdir()
        return True

    def create(self) -> None:
        self.check_creatable()
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UserError(f"run dir {self.path}: cannot create it: {describe(e)}; give a "
                            "writable --run-dir") from None

    def lock(self, allow_parent: bool = False, wait_s: float = 0.0) -> None:
        """Takes the run's lock (lock.py), or raises RunDirBusy naming the holder."""
        self.create()
        self._lock.take(allow_parent, wait_s)

    def check_free(self) -> None:
        """RunDirBusy when another run holds the lock; takes and writes nothing."""
        self._lock.check_free()

    def take_lease(self, restart: bool, take_over: bool, stale_s: float) -> None:
        """With checkpoint_url: this job's lease of it (checkpoint/lease.py), or LeaseHeld."""
        if self.remote:
            self.lease = Lease(self.remote, self.path)
            self.lease.acquire(restart, take_over, stale_s)
            self.lease.keep(stale_s)  # renewed on its own clock, not only at checkpoints

    def unlock(self) -> None:
        if self.lease is not None:
            self.lease.release()
            self.lease = None
        self._lock.release()

    @contextlib.contextmanager
    def locked(self):
        self.lock()
        try:
            yield self
        finally:
            self.unlock()

    # ---- which job trains here -------------------------------------------------------------

    def known_launchers(self) -> set[str]:
        """The launchers job.json lists: those of the job that trained here last."""
        try:
            return set(json.loads(self.job.read_text())["launchers"])
        except (OSError, ValueError, KeyError, TypeError):
            return set()

    def record_job(self, launchers: set[str], first_start: bool) -> None:
        """job.json: this start's launchers, and on a restart also the job's earlier ones (a
        node that left may come back under the same agent)."""
        known = set() if first_start else self.known_launchers()
        text = json.dumps({"launchers": sorted(known | launchers)}) + "\n"
        if self.remote:
            location.replace_file(self.job, text.encode())
        else:
            replace_text(self.job, text)

    # ---- what a run writes --------------------------------------------------------------------

    def write_config(self, config: dict, step: int, world_size: int) -> None:
        """config.json is this start's config (what `--nproc` workers start from); every start
        whose config or world size differs from the previous start's, or that starts before it
        (a run gone back to an older checkpoint), is also appended to configs.jsonl, with the
        step it started from, so what each stretch of the run trained with stays known. First,
        the logs at the checkpoint URL if they go further than this run dir's (logs.adopt)."""
        logs.adopt(self)
        replace_text(self.config, json.dumps(config, indent=1) + "\n")
        history = self.configs
        last = {}
        if history.is_file():
            lines = history.read_text().splitlines()
            with contextlib.suppress(ValueError, IndexError):
                last = json.loads(lines[-1])
        if not isinstance(last, dict):
            last = {}
        if (last.get("config"), last.get("world_size"), last.get("step", -1) <= step) != (
                config, world_size, True):
            try:
                with open(history, "a") as f:
                    f.write(json.dumps({"step": step, "saved_at": time.time(),
                                        "world_size": world_size, "config": config}) + "\n")
            except OSError as e:
                raise WriteError(f"cannot write {history}: {describe(e)}") from None

    def last_world_size(self) -> int | None:
        """The number of processes the run's latest start trained on (configs.jsonl's last
        entry: a start that changed nothing adds none), or None when nothing says."""
        try:
            lines = self.configs.read_text().splitlines()
            world = json.loads(lines[-1])["world_size"]
        except (OSError, ValueError, IndexError, KeyError, TypeError):
            return None
        return world if isinstance(world, int) and world >= 1 else None

    def write_data_files(self, dataset_dir: Path, meta_bytes: bytes,
                         sources: list[dict] | None = None) -> None:
        """The dataset's meta.json and tokenizer, so that `sample` needs only the run dir; a
        mixture's (`sources`: each one's name, dir, weight, fingerprint) in data_sources.json
        beside its first dataset's meta.json (they share the tokenizer)."""
        files = storage.open_dir(dataset_dir)
        tokenizer = files.read("tokenizer.json") if files.has("tokenizer.json") else None
        replace_text(self.data_meta, meta_bytes.decode())
        if sources is not None:
            replace_text(self.path / "data_sources.json", json.dumps(sources, indent=1) + "\n")
        if tokenizer is not None:
            replace_text(self.tokenizer, tokenizer.decode())
        if self.remote:  # what eval, sample and export --run-dir URL read beside the checkpoints
            location.replace_file(self.remote / self.data_meta.name, meta_bytes)
            if tokenizer is not None:
                location.replace_file(self.remote / self.tokenizer.name, tokenizer)

    def set_aside(self, kind: str, paths: list) -> Path | None:
        """Moves `paths` (checkpoint dirs, metrics.jsonl) into a new `<kind>-<time>/`, keeping
        their places below the run dir: nothing is deleted. Checkpoints in object storage go
        into `<kind>-<time>/` at their URL (location.move: copied, then deleted)."""
        remote = [p for p in paths if location.is_remote(p)]
        paths = [p for p in paths if not location.is_remote(p) and p.exists()]
        if not paths and not remote:
            return None
        base = aside = self.path / time.strftime(f"{kind}-%Y%m%d-%H%M%S")
        n = 1
        while aside.exists():  # twice in one second
            aside, n = base.with_name(f"{base.name}-{n}"), n + 1
        for path in remote:
            location.move(path, self.remote / aside.name / path.name)
        try:
            for path in paths:
                target = aside / path.relative_to(self.path)
                target.parent.mkdir(parents=True, exist_ok=True)
                move(path, target)
        except OSError as e:
            raise WriteError(f"cannot move {path} into {aside}: {describe(e)}") from None
        return aside if paths or not remote else self.remote / aside.name

    def reset(self, why: str = "--reset") -> None:
        """--reset (or `why` the run starts over): the checkpoints, metrics and tracker files go
        into reset-<time>/ (a new tracker run begins)."""
        checkpoints = [p for p in location.children(self.remote) if p.name.startswith("step_")
                       or p.name == "rollback.json"] if self.remote else [self.checkpoints]
        files = [*checkpoints, self.metrics, self.configs, *self.tracker_files]
        if aside := self.set_aside("reset", files):
            say(f"ddpgpt: {why}: moved the previous checkpoints and metrics to {aside}")

    def rewind(self, newer: list[Path], step: int) -> None:
        """--resume PATH of this run dir: checkpoints after PATH, and a copy of the metrics,
        go into rewind-<time>/ before the run continues from PATH (metrics are cut back). (A
        rollback is the spike guard's, guard/spike.py: back to a healthy checkpoint.)"""
        aside = self.set_aside("rewind", newer)
        if aside is None:
            return
        if self.metrics.is_file():
            local = self.path / aside.name
            local.mkdir(parents=True, exist_ok=True)
            shutil.copy2(self.metrics, local / self.metrics.name)
        names = ", ".join(p.name for p in newer)
        print(f"ddpgpt: --resume: continuing from step {step}; moved the later checkpoints "
              f"({names}) and a copy of the metrics to {aside}", file=sys.stderr)

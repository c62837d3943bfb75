"""The encode-and-assemble loop of `prepare`, resumable, for a whole corpus, a part, or a merge.

Its state lives in the partial directory: `settings.json` (what is being prepared: sources and
their sizes and times, tokenizer, every setting that changes a byte), `units/` (finished units
not yet in the shards, see units.py) and `progress.json` (the assembler's state, saved every
`COMMIT_SECONDS` after the shards it counts are on the disk). A run that finds them continues:
units already in the shards are skipped, finished ones are not encoded again, and the shards are
cut back to the length progress.json records. The unit of progress is one unit (formats/:
at most ~8 MB of text files or jsonl, one parquet row group, one compressed jsonl file).
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from ddpgpt import progress
from ddpgpt.data.formats.table import FORMATS, Plan
from ddpgpt.data.prepare import units as unitfiles
from ddpgpt.data.prepare.assemble import Assembler
from ddpgpt.errors import UserError
from ddpgpt.files import atomic_write

COMMIT_SECONDS = 2.0
AHEAD_PER_WORKER = 4  # units encoded ahead of the assembler, per worker: bounds the disk used


def check_settings(tmp: Path, settings: dict, out: Path) -> bool:
    """Records `settings` in a new partial; in one left by an earlier run, refuses other
    settings. Returns whether there is earlier progress to continue."""
    path = tmp / "settings.json"
    settings = json.loads(json.dumps(settings))  # as read back: lists for tuples
    if not path.is_file():
        _write_json(path, settings)
        return False
    old = json.loads(path.read_text())
    if old != settings:
        changed = _first_difference(old, settings)
        raise UserError(f"--out {out}: {tmp} holds an unfinished prepare of other sources or "
                        f"settings ({changed}); run that command again to finish it, or remove "
                        f"{tmp} (rm -r) to start over")
    return True


def _first_difference(old: dict, new: dict) -> str:
    if old.get("stamps") != new.get("stamps") and old.get("sources") == new.get("sources"):
        return "the source files changed"
    for key in sorted(set(old) | set(new)):
        if old.get(key) != new.get(key):
            if key in ("plan", "stamps", "sources"):
                return "the sources changed"
            return f"{key}: {old.get(key)} -> {new.get(key)}"
    return "unknown"


def _write_json(path: Path, value) -> None:
    with atomic_write(path) as f:
        f.write(json.dumps(value, separators=(",", ":")).encode())


class Build:
    """One prepare's units -> shards (or, for a part, -> unit files), resumable."""

    def __init__(self, tmp: Path, plan: Plan, asm: Assembler | None, workers: int,
                 encoder_args: tuple, owned: range | None = None):
        self.tmp, self.plan, self.asm = tmp, plan, asm
        self.work = tmp / "units"
        self.work.mkdir(exist_ok=True)
        self.workers, self.encoder_args = workers, encoder_args
        self.owned = owned if owned is not None else range(len(plan.units))
        self.sources: dict[int, Path] = {}  # a merge: the part directory of each unit
        self.local_tok = None  # the tokenizer of this process, for one worker
        self.progress = tmp / "progress.json"
        self.committed = 0  # units in the shards that progress.json counts
        if asm is not None and self.progress.is_file():
            asm.load_state_dict(json.loads(self.progress.read_text()))
            self.committed = asm.units
        self._last, self._dropped = 0.0, self.committed

    @property
    def done(self) -> int:
        """Units whose work a kill now would not lose: in the shards that progress.json
        counts (read from it: a signal may land between its write and our note of it), or (a
        part) encoded."""
        if self.asm is None:
            return sum(unitfiles.is_done(self.work, i) for i in self.owned)
        try:
            return int(json.loads(self.progress.read_text())["units"])
        except (OSError, ValueError, KeyError):
            return 0

    def run(self) -> None:
        """Encodes the units still to do and assembles them in order."""
        start = self.asm.units if self.asm else 0
        todo = [(i, u) for i, u in enumerate(self.plan.units) if i in self.owned and i >= start
                and i not in self.sources and not FORMATS[u.kind].tokens
                and not unitfiles.is_done(self.work, i)]
        workers = max(1, min(self.workers, len(todo)))
        bar = progress.bar(total=len(self.owned), initial=self.done, unit="unit", desc="prepare")
        encoder = unitfiles.Encoder(workers, *self.encoder_args, local=self.local_tok) \
            if todo else None
        ahead = workers * AHEAD_PER_WORKER
        try:
            if encoder is not None:
                limit = (lambda i: i < self.asm.units + ahead) if self.asm else (lambda i: True)
                for _ in encoder.run(iter(todo), limit):
                    if self.asm is None:
                        bar.update(1)
                    elif self._assemble_ready(bar):
                        break
            if self.asm is not None:
                self._assemble_ready(bar)
                self._commit(force=True)
        finally:
            if encoder is not None:
                encoder.close()
            bar.close()

    def _assemble_ready(self, bar) -> bool:
        """Appends every unit that is ready, in order; True once --max-tokens is reached."""
        units = self.plan.units
        while self.asm.units < len(units) and not self.asm.full:
            index = self.asm.units
            unit = units[index]
            row = FORMATS[unit.kind]
            if row.tokens:  # tokens already (llm.c shards), checked before any is written
                self.asm.add(row.array(unit), {"split": unit.split})
            else:
                work = self.sources.get(index, self.work)
                if not unitfiles.is_done(work, index):  # waiting for the workers: a good
                    if self.asm.units > self.committed:  # moment to save what is there
                        self._commit(force=True)
                    return False
                tokens, record, mask = unitfiles.read_unit(work, index)
                self.asm.add(tokens, record, mask)
                del tokens, mask
            bar.update(1)
            self._commit()
        return self.asm.full

    def _commit(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last < COMMIT_SECONDS:
            return
        self._last = now
        self.asm.sync()
        _write_json(self.progress, self.asm.state_dict())
        self.committed = self.asm.units
        if not self.sources:  # our own unit files: in the shards now, not needed again
            for index in range(self._dropped, self.asm.units):
                for path in (*unitfiles.unit_paths(self.work, index),
                             unitfiles.mask_path(self.work, index)):
                    path.unlink(missing_ok=True)
            self._dropped = self.asm.units

    def restart_assembly(self) -> None:
        """Before a step that rewrites shards in place: from here a kill starts the assembly
        over (the units' tokens are gone, so they are encoded again)."""
        self.progress.unlink(missing_ok=True)

    def clean(self) -> None:
        """Removes the resume state once the output is complete."""
        shutil.rmtree(self.work, ignore_errors=True)
        for name in ("progress.json", "settings.json", "lock"):
            (self.tmp / name).unlink(missing_ok=True)


def part_range(n_units: int, part: tuple[int, int]) -> range:
    """Part I of N: a contiguous 1/N of the units (by index), the same on every machine."""
    i, n = part
    return range((i - 1) * n_units // n, i * n_units // n)

"""Mixtures: several prepared datasets trained on in given token proportions.

    ddpgpt train --data data/stdlib:0.7,data/prose:0.3 ...     # or [[data.sources]] in TOML

Every row of a global batch is one window of T+1 tokens of one source, so token proportions are
row proportions. Above each source's windows (loader.TokenStream, and its epochs' orders from
order.py) two things decide a step's rows:

- The schedule: which source global row n takes (n counts every row since the mixture's
  weights took effect). Each weight is held as an integer share P_i of R = 10^6 (largest
  remainder, so they sum to R exactly), and the rows are split source by source: source 1 takes
  floor(n · P_1 / R) of the first n rows, source 2 floor(rest · P_2 / (R − P_1)) of the rest,
  and so on, the last source the remainder. Every count is a pure function of n (no state but
  n), grows by 0 or 1 from row to row, and is within i of P_i/R · n for the i-th source
  (each level rounds once); so over any span of rows a source's share is off by at most
  2·(sources) rows: 0.1% of 100 steps of 16 rows for two sources.
- A cursor per source: source i's row takes the next window of its own order, position
  base_i + (its count so far): epochs follow each other without a dropped tail (a source of
  few windows simply goes round more often).

So the rows of step k depend only on (the sources, their weights, seed, T, G, k), not on W or A;
rank r at micro-step m takes rows (m·W + r)·b ... (m·W + r)·b + b of the step, as the one-dataset
loader does. The state is the step count and, for each stretch of steps trained under one set
of weights (a resume may change them: a new stretch starts, recorded, never silently), its first
step, its shares and where each source's cursor stood: every batch ever read can be read again
(a loss spike's probe) at any W.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from ddpgpt.data import order as orders
from ddpgpt.data import storage
from ddpgpt.data.loader import (
    TrainLoader,
    _new_buffer,
    _to_device,
    require_windows,
    row_source,
)
from ddpgpt.data.packing import conversations_note, one_document
from ddpgpt.data.shards import TokenDataset
from ddpgpt.errors import DataError

RESOLUTION = 10**6  # a weight's integer share of this (1e-6 of the asked proportion at worst)
STATE_VERSION = 1


def open_data(sources: list[tuple[str, float]]) -> TokenDataset | MixedDataset:
    """data.dir's datasets (DataConfig.sources): one TokenDataset, or a mixture of several."""
    if len(sources) == 1:
        return TokenDataset(sources[0][0])
    return MixedDataset(sources)


def datasets(data: TokenDataset | MixedDataset) -> list[TokenDataset]:
    """Every dataset `data` reads."""
    return data.datasets if isinstance(data, MixedDataset) else [data]


def unique_names(dirs: list[str]) -> list[str]:
    """Each dataset's name in metrics (val_loss/NAME): its directory's name, with the parent's
    prefixed where two share one (data/a and other/a: data-a, other-a), else a count."""
    base = [storage.name_of(d) for d in dirs]
    names = [b if base.count(b) == 1 else f"{storage.name_of(_parent(d))}-{b}"
             for d, b in zip(dirs, base)]
    seen: dict[str, int] = {}
    out = []
    for name in names:
        seen[name] = seen.get(name, 0) + 1
        out.append(name if seen[name] == 1 else f"{name}-{seen[name]}")
    return out


def _parent(where: str) -> str:
    return where.rstrip("/").rsplit("/", 1)[0] if storage.is_url(where) else \
        str(Path(where).resolve().parent)


def shares(weights: list[float]) -> list[int]:
    """Weights (summing to 1) as integer shares of RESOLUTION that sum to it exactly (largest
    remainder); every share at least 1."""
    raw = [w * RESOLUTION for w in weights]
    out = [max(1, int(r)) for r in raw]
    by_remainder = sorted(range(len(raw)), key=lambda i: (out[i] - raw[i], i))
    for i in by_remainder[:RESOLUTION - sum(out)]:
        out[i] += 1
    while sum(out) > RESOLUTION:  # the floor of 1 on a tiny weight: taken from the largest
        out[out.index(max(out))] -= 1
    return out


class MixedDataset:
    """Several prepared datasets with their shares: what a run trains on when data.dir names a
    mixture. It answers what a run asks of its data (the tokenizer, the vocabulary, one
    fingerprint, the data files a run dir keeps) for all of them; the datasets must share a
    tokenizer."""

    def __init__(self, sources: list[tuple[str, float]]):
        self.datasets = [TokenDataset(d) for d, _ in sources]
        self.weights = [w for _, w in sources]
        self.names = unique_names([d for d, _ in sources])
        _refuse_twice([d for d, _ in sources], self.datasets)
        first = self.datasets[0]
        for ds in self.datasets[1:]:
            if ds.tokenizer_fingerprint != first.tokenizer_fingerprint:
                raise DataError(
                    f"data.dir: {first.path} and {ds.path} have different tokenizers "
                    f"({first.tokenizer_fingerprint[:20]}, {ds.tokenizer_fingerprint[:20]}): a "
                    f"mixture's ids must mean the same text; prepare {ds.path} again with "
                    f"--tokenizer-from {first.path}")
        self.path, self.meta_bytes, self.tokenizer = first.path, first.meta_bytes, first.tokenizer
        self.vocab_size, self.eot_id, self.dtype = first.vocab_size, first.eot_id, first.dtype
        self.masked = any(ds.masked for ds in self.datasets)  # conversations among them
        lacking = [ds for ds in self.datasets if ds.split_bytes is None]
        self.split_bytes = None if lacking else {}
        self._lacking = lacking[0] if lacking else None

    @property
    def fingerprint(self) -> str:
        """The datasets' identity, not their weights (a resume may change those) nor where
        they are: sha256 over their fingerprints."""
        text = "\n".join(sorted(ds.fingerprint for ds in self.datasets))
        return hashlib.sha256(f"mixture\n{text}".encode()).hexdigest()

    @property
    def tokenizer_fingerprint(self) -> str:
        return self.datasets[0].tokenizer_fingerprint

    def sources(self) -> list[dict]:
        """What a run dir records of each source (data_sources.json)."""
        return [{"name": n, "dir": str(ds.path), "weight": w, "fingerprint": ds.fingerprint}
                for n, ds, w in zip(self.names, self.datasets, self.weights)]

    def bytes_advice(self) -> str:
        return self._lacking.bytes_advice() if self._lacking else ""

    def verify(self, part: int = 0, parts: int = 1) -> int:
        return sum(ds.verify(part, parts) for ds in self.datasets)


def _refuse_twice(dirs: list[str], opened: list[TokenDataset]) -> None:
    """One dataset under two spellings (d1 and ./d1, d1/, a symlink to it) or two copies of it
    (the same meta.json) would be two sources with the same windows in the same order: every
    batch would hold each of its windows twice. One line instead."""
    seen: dict[tuple[str, str], str] = {}
    for spelled, ds in zip(dirs, opened):
        for key in (("dir", str(Path(ds.path).resolve())), ("fingerprint", ds.fingerprint)):
            if key in seen:
                same = "directory" if key[0] == "dir" else "data (the same meta.json)"
                raise DataError(f"data.dir: {seen[key]} and {spelled} are the same {same}: "
                                "the mixture would train on each of its windows twice; give "
                                "it once, with its whole weight")
            seen[key] = spelled


def counts(n: np.ndarray, parts: list[int]) -> np.ndarray:
    """How many of the first n rows (each entry of `n`, int64) each source takes: shape
    (sources, len(n)); see the module docstring."""
    out = np.zeros((len(parts), len(n)), dtype=np.int64)
    rest, left = np.asarray(n, dtype=np.int64), RESOLUTION
    for i, p in enumerate(parts):
        out[i] = rest if i == len(parts) - 1 else rest * p // left
        rest, left = rest - out[i], left - p
    return out


class MixtureLoader:
    """Yields each optimizer step's micro-batches of a mixture for one rank; TrainLoader's
    interface (next_step, batch, skip, batch_index, the state) over MixedDataset's sources."""

    def __init__(self, data: MixedDataset, *, seq_len: int, micro_batch: int,
                 world_size: int = 1, rank: int = 0, accum_steps: int = 1, seed: int = 0,
                 shuffle: bool = True, device: str | torch.device = "cpu",
                 align: str = "stream", cache: str = ""):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world size {world_size}")
        self.names = data.names
        self.fingerprints = [ds.fingerprint for ds in data.datasets]
        self.streams = [row_source(ds, "train", seq_len, align, cache) for ds in data.datasets]
        for stream in self.streams:
            require_windows(stream, 1)
        # Conversations among the sources: every row's targets follow its mask (a plain
        # source's are all ones), and the loss is normalized by the unmasked count (trainer).
        self.masked = any(stream.masked for stream in self.streams)
        self.seq_len, self.micro_batch = seq_len, micro_batch
        self.world_size, self.rank, self.accum_steps = world_size, rank, accum_steps
        self.global_batch = world_size * accum_steps * micro_batch
        self.seed, self.shuffle, self.align = seed, shuffle, align
        self.device = torch.device(device)
        self.batch_index = 0  # global batches read (or skipped)
        self.stretches = [{"start": 0, "parts": shares(data.weights),
                           "base": [0] * len(self.streams)}]
        self.changed: dict | None = None  # the weights a resume changed: {"old", "new"}
        self._orders: dict[tuple[int, int], orders.Order] = {}

    def rows(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """Global batch `index`'s G rows: (source of each, window of each in its source)."""
        stretch = next(s for s in reversed(self.stretches) if s["start"] <= index)
        first = (index - stretch["start"]) * self.global_batch
        n = np.arange(first, first + self.global_batch + 1, dtype=np.int64)
        taken = counts(n, stretch["parts"])  # (sources, G+1)
        source = np.argmax(np.diff(taken, axis=1), axis=0)  # (G,): the one count that grew
        windows = np.empty(self.global_batch, dtype=np.int64)
        for i in range(len(self.streams)):
            mine = np.flatnonzero(source == i)
            if len(mine):
                start = stretch["base"][i] + int(taken[i, 0])
                windows[mine] = self._windows(i, start, start + len(mine))
        return source, windows

    def _windows(self, i: int, start: int, stop: int) -> np.ndarray:
        """Source i's windows at absolute positions start..stop-1 of its epochs, one after
        another."""
        n, parts = self.streams[i].num_windows, []
        while start < stop:
            epoch, pos = divmod(start, n)
            take = min(stop - start, n - pos)
            key = (i, epoch)
            if key not in self._orders:
                self._orders = {k: v for k, v in self._orders.items() if k[0] != i}
                self._orders[key] = orders.epoch_order(n, self.seed, epoch, self.shuffle)
            parts.append(self._orders[key].items(pos, pos + take))
            start += take
        return np.concatenate(parts)

    def taken(self, index: int) -> list[int]:
        """Rows each source gave to global batches 0..index-1 of the current stretch and all
        before it (metrics: the realized proportions)."""
        stretch = next(s for s in reversed(self.stretches) if s["start"] <= index)
        now = counts(np.array([(index - stretch["start"]) * self.global_batch]), stretch["parts"])
        return [int(b + c) for b, c in zip(stretch["base"], now[:, 0])]

    def taken_now(self) -> dict[str, int]:
        """{source name: rows it gave to the global batches read so far}."""
        return dict(zip(self.names, self.taken(self.batch_index)))

    def next_step(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Advances by one step (G rows) and returns this rank's A micro-batches (x, y)."""
        self.batch_index += 1
        self._prefetch(self.batch_index - 1)
        self._prefetch(self.batch_index)  # the next step's, fetched while this one computes
        return self.batch(self.batch_index - 1)

    def _prefetch(self, index: int) -> None:
        """This rank's rows of global batch `index`, named to each source's reader."""
        source, windows = self.rows(index)
        b, W = self.micro_batch, self.world_size
        mine = np.concatenate([np.arange((m * W + self.rank) * b, (m * W + self.rank + 1) * b)
                               for m in range(self.accum_steps)])
        for i, stream in enumerate(self.streams):
            stream.prefetch(windows[mine[source[mine] == i]])

    def batch(self, index: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's micro-batches of global batch `index`, the cursor unmoved."""
        source, windows = self.rows(index)
        b, W, span = self.micro_batch, self.world_size, self.seq_len + 1
        for m in range(self.accum_steps):
            start = (m * W + self.rank) * b
            buf = _new_buffer(b, span, self.device)
            mask = _new_buffer(b, span, self.device, torch.uint8) if self.masked else None
            for i, stream in enumerate(self.streams):
                mine = np.flatnonzero(source[start:start + b] == i)
                if len(mine):
                    rows = np.empty((len(mine), span), dtype=np.int64)
                    masks = np.empty((len(mine), span), dtype=np.uint8)
                    stream.read(windows[start + mine], rows, masks if self.masked else None)
                    buf.numpy()[mine] = rows
                    if mask is not None:  # a plain source's: all ones
                        mask.numpy()[mine] = masks
            yield _to_device(buf, self.device, mask)

    def skip(self, batches: int) -> list[dict]:
        """Past `batches` global batches unread (a rollback); returns [{"start", "end"}], the
        global batches skipped (end exclusive)."""
        start, self.batch_index = self.batch_index, self.batch_index + batches
        return [{"start": start, "end": self.batch_index}] if batches else []

    def state_dict(self) -> dict:
        return {"version": STATE_VERSION, "mixture": self.names,
                "fingerprints": self.fingerprints, "batch": self.batch_index,
                "stretches": [dict(s) for s in self.stretches], "seed": self.seed,
                "seq_len": self.seq_len, "shuffle": self.shuffle, "align": self.align,
                "num_windows": [s.num_windows for s in self.streams]}

    def load_state_dict(self, state: dict) -> None:
        """Continues from a saved cursor at any W. Other weights than the saved ones (a resume
        with a changed mixture) start a new stretch here, each source's cursor where it stood;
        `changed` then says what changed, for the run to record."""
        if "mixture" not in state:
            raise DataError("the checkpoint was trained on one dataset, this run on a mixture: "
                            "resume with its --data, or --data.allow-switch to go on with the "
                            "mixture")
        state = {"align": "stream", **state}  # saved before data.align existed: the stream's
        for key in ("seed", "seq_len", "shuffle", "align"):
            if state[key] != getattr(self, key):
                raise DataError(f"the checkpoint's data order was read with data.{key} = "
                                f"{state[key]}, this run has {getattr(self, key)}: resume with "
                                f"--data.{key.replace('_', '-')} {str(state[key]).lower()}, or "
                                "start a new --run-dir")
        if state["fingerprints"] != self.fingerprints or \
                state["num_windows"] != [s.num_windows for s in self.streams]:
            raise DataError(f"loader state holds the mixture {', '.join(state['mixture'])}, "
                            f"this run {', '.join(self.names)}, not the same datasets in the "
                            "same order: resume on the same datasets, in the same order")
        if int(state["version"]) > STATE_VERSION:
            raise DataError(f"the checkpoint's mixture state is version {state['version']}, "
                            "newer than this ddpgpt reads; upgrade ddpgpt")
        parts = self.stretches[0]["parts"]
        self.batch_index = int(state["batch"])
        self.stretches = [dict(s) for s in state["stretches"]]
        old = self.stretches[-1]["parts"]
        if old != parts:
            self.stretches.append({"start": self.batch_index, "parts": parts,
                                   "base": self.taken(self.batch_index)})
            self.changed = {"old": dict(zip(self.names, [p / RESOLUTION for p in old])),
                            "new": dict(zip(self.names, [p / RESOLUTION for p in parts]))}


def packing_notes(loader: TrainLoader | MixtureLoader) -> tuple[list[str], list[str]]:
    """What a run's start says of its training rows, each source's: warnings for rows packed
    from a split of one document (packing.one_document), and notes on rows packed from
    conversations (packing.conversations_note: the ones split across rows, the padding)."""
    streams = loader.streams if isinstance(loader, MixtureLoader) else [loader.stream]
    return ([note for note in map(one_document, streams) if note],
            [note for note in map(conversations_note, streams) if note])


def taken_now(loader: TrainLoader | MixtureLoader) -> dict[str, int] | None:
    """A mixture's rows so far per source (metrics' mix/NAME); None for one dataset."""
    return loader.taken_now() if isinstance(loader, MixtureLoader) else None


def train_loader(data: TokenDataset | MixedDataset, **kwargs) -> TrainLoader | MixtureLoader:
    """The training loader of one dataset (TrainLoader) or of a mixture (MixtureLoader), with
    the same arguments (seq_len, micro_batch, world_size, rank, accum_steps, seed, shuffle,
    device, align)."""
    if isinstance(data, MixedDataset):
        return MixtureLoader(data, **kwargs)
    return TrainLoader(data, **kwargs)

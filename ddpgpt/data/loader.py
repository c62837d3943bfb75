"""Distributed token loader: each rank reads its own windows, in an order independent of W.

Ordering guarantee. The split's shards form one token stream. It is cut into windows that start
T tokens apart and read T+1 tokens (x = the first T, y = the same shifted by one), so there are
(N - 1) // T windows. Each epoch visits them in an order seeded by (seed, epoch) (order.py: a
bijection computed position by position, O(1) memory whatever N; file order with shuffle off).
Optimizer step k takes the next G = W·A·b windows of that order; within the step, rank r at
micro-step m takes positions (m·W + r)·b ... (m·W + r)·b + b. Hence:

- the windows of step k depend only on (dataset, seed, T, G, k), not on W or A;
- ranks never share a window within a step, and every window is used once per epoch;
- the last (windows mod G) windows of each epoch's order are dropped, not wrapped: an epoch has
  windows // G steps (the dropped ones differ from epoch to epoch since the order does);
- the state is one global cursor (epoch, windows consumed in it) and the order's version, so a
  run saved at W=4 resumes at W=2 (same G) with exactly the next windows, and a run saved with
  the order of earlier versions (a permutation built whole) resumes on that order; skipping
  global batches (a rollback past the data of a loss spike) moves that cursor, so it too is the
  same at every W.

With data.align = bos the "windows" are packed rows that start at document starts (packing.py:
a fixed packing of the split, the same interface as the stream's windows), visited the same way,
so all of the above holds for them; the state records which.

Everything is passed in; the loader reads no environment variables and calls no collectives, so a
single-process test can play rank 3 of 4. Reading is one pread per window (per shard it crosses)
from the shard files: a rank reads only its own windows' bytes, and its memory does not grow with
the data it samples. For a dataset in object storage a window is a ranged read, and each step
names the windows of the steps after it to the reader (`prefetch`), which fetches them in the
background while this step computes: as many steps as a fetch takes to arrive in step times,
plus one (2 to 16 steps, 64 MiB of windows at most: fetch.ahead_steps; data/storage.py).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import torch

from ddpgpt.data import order as orders
from ddpgpt.data import packing
from ddpgpt.data.fetch import ahead_steps
from ddpgpt.data.shards import TokenDataset
from ddpgpt.data.stream import TokenStream
from ddpgpt.errors import DataError

RAMP = 2  # steps newly named to a remote reader per step at most (_fetch_ahead)
STATE_VERSION = 3  # 2: records the order's version (absent: 1, the permutation built whole);
# 3: records data.align (absent: stream)


def row_source(dataset: TokenDataset, split: str, seq_len: int, align: str = "stream",
               cache: str = ""):
    """data.align's rows of a split: this module's windows (stream) or packed rows that start at
    document starts (bos: packing.py, which reads through a TokenStream). `cache`: data.cache."""
    return packing.row_source(dataset, split, seq_len, align, cache)


def _to_device(buf: torch.Tensor, device: torch.device,
               mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(b, T+1) tokens -> x, y views of shape (b, T) on `device`. `mask` (b, T+1, uint8): the
    tokens' loss mask; a target whose mask is 0 becomes -1, which the loss ignores."""
    if device.type == "cuda":
        # buf is pinned; the caching host allocator keeps it alive until the copy has run.
        buf = buf.to(device, non_blocking=True)
        mask = None if mask is None else mask.to(device, non_blocking=True)
    if mask is None:
        return buf[:, :-1], buf[:, 1:]
    return buf[:, :-1], buf[:, 1:].masked_fill(mask[:, 1:] == 0, -1)


def _new_buffer(rows: int, span: int, device: torch.device,
                dtype: torch.dtype = torch.int64) -> torch.Tensor:
    return torch.empty((rows, span), dtype=dtype, pin_memory=device.type == "cuda")


def read_rows(stream, rows: np.ndarray, b: int, device: torch.device
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`rows` of a row source into a new (b, T+1) buffer (rows past len(rows) left unset), and,
    for a source of conversations (`masked`), their masks (b, T+1) beside it."""
    span = stream.seq_len + 1
    buf = _new_buffer(b, span, device)
    mask = _new_buffer(b, span, device, torch.uint8) if stream.masked else None
    stream.read(rows, buf.numpy(), None if mask is None else mask.numpy())
    return buf, mask


def require_windows(stream: TokenStream, need: int, what: str = "") -> None:
    """A DataError unless the stream has `need` windows (`what` says what they are for)."""
    if stream.num_windows < need:
        batch = " / data.global_batch" if what else ""
        raise DataError(f"dataset {stream.dataset_path}: the {stream.split} split has "
                        f"{stream.num_windows} windows of {stream.seq_len + 1} tokens, fewer than "
                        f"{what}{need}; use a larger dataset, or a smaller data.seq_len{batch}")


class TrainLoader:
    """Yields each optimizer step's micro-batches for one rank; see the module docstring."""

    def __init__(self, dataset: TokenDataset, *, seq_len: int, micro_batch: int,
                 world_size: int = 1, rank: int = 0, accum_steps: int = 1, seed: int = 0,
                 shuffle: bool = True, split: str = "train", device: str | torch.device = "cpu",
                 align: str = "stream", cache: str = ""):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world size {world_size}")
        self.stream = row_source(dataset, split, seq_len, align, cache)
        self.align = align
        self.masked = self.stream.masked  # conversations: targets outside the mask are -1
        self.seq_len, self.micro_batch = seq_len, micro_batch
        self.world_size, self.rank, self.accum_steps = world_size, rank, accum_steps
        self.global_batch = world_size * accum_steps * micro_batch
        self.seed, self.shuffle = seed, shuffle
        self.device = torch.device(device)
        require_windows(self.stream, self.global_batch, "one global batch of ")
        self.epoch, self.consumed = 0, 0
        self.order_version = orders.VERSION
        self._order: orders.Order | None = None
        self._order_epoch = -1
        self.fetched_until = 0  # the global batches before this one are named to the reader
        self.ahead = 0  # how many steps' windows the last step named, its own included
        self.step_s = 0.0  # seconds between two steps but their reads (a moving average)
        self.read_s = 0.0  # seconds this step spent reading its windows so far
        self._last_step: float | None = None

    @property
    def steps_per_epoch(self) -> int:
        return self.stream.num_windows // self.global_batch

    def order(self, epoch: int) -> orders.Order:
        """The visiting order of `epoch`'s windows (kept for the epoch: version 1 builds it)."""
        if self._order is None or self._order_epoch != epoch:
            self._order = orders.epoch_order(self.stream.num_windows, self.seed, epoch,
                                             self.shuffle, self.order_version)
            self._order_epoch = epoch
        return self._order

    @property
    def batch_index(self) -> int:
        """The ordinal of the global batch the next step reads (0, 1, ...; every epoch has
        steps_per_epoch of them): what a straight run's step k+1 reads is batch k."""
        return self.epoch * self.steps_per_epoch + self.consumed // self.global_batch

    def _advance(self) -> int:
        """Moves the cursor past the next global batch; returns where it starts in the epoch's
        order (self.epoch is then the batch's epoch)."""
        if self.consumed + self.global_batch > self.stream.num_windows:
            self.epoch, self.consumed = self.epoch + 1, 0  # drop the epoch's partial last step
        self.consumed += self.global_batch
        return self.consumed - self.global_batch

    def next_step(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Advances the cursor by one step (G windows) and returns this rank's A micro-batches,
        read lazily: an iterator of (x, y), int64, each of shape (b, T)."""
        start = self._advance()
        step = self.order(self.epoch).items(start, start + self.global_batch)
        self._fetch_ahead()
        return self._micro_batches(step)

    def _fetch_ahead(self) -> None:
        """Names to a remote reader the windows of this step and of the steps after it in the
        epoch, as many as a fetch's arrival time takes in step times (fetch.ahead_steps), each
        step's in one concurrent batch; only the ones not named yet, RAMP more a step."""
        now = time.monotonic()
        if self._last_step is not None:  # the step's own time: what it waited for data not
            took = max(1e-3, now - self._last_step - self.read_s)  # (or a wait sustains itself)
            self.step_s = took if not self.step_s else 0.5 * (self.step_s + took)
        self._last_step, self.read_s = now, 0.0
        tokens = getattr(self.stream, "stream", self.stream)  # packed rows: their stream's
        step_bytes = self.accum_steps * self.micro_batch * (self.seq_len + 1) * \
            tokens.dtype.itemsize * (2 if self.masked else 1)  # this rank's windows of a step
        self.ahead = ahead_steps(self.stream.arrival_s, self.step_s, step_bytes)
        current = self.batch_index - 1
        first = max(self.fetched_until, current)
        # at most RAMP new steps a step once some are named ahead: a distance that grows (a slow
        # first answer, a slower store) does not send a burst of GETs at once
        last = current + self.ahead
        if self.fetched_until > current:
            last = min(last, first + RAMP)
        for index in range(first, last):
            epoch, k = divmod(index, self.steps_per_epoch)
            if epoch != self.epoch:  # the next epoch's order: named once it starts
                break
            start = k * self.global_batch
            self.stream.prefetch(self.mine(self.order(epoch).items(start,
                                                                   start + self.global_batch)))
            self.fetched_until = index + 1

    def mine(self, step: np.ndarray) -> np.ndarray:
        """This rank's windows of a step's G, in the order its micro-batches read them."""
        b, W = self.micro_batch, self.world_size
        return np.concatenate([step[(m * W + self.rank) * b:(m * W + self.rank + 1) * b]
                               for m in range(self.accum_steps)])

    def batch(self, index: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's micro-batches of global batch `index` (as batch_index counts), without
        moving the cursor: the same windows at any W (a loss spike's probe reads them again)."""
        epoch, k = divmod(index, self.steps_per_epoch)
        start = k * self.global_batch
        return self._micro_batches(self.order(epoch).items(start, start + self.global_batch))

    def skip(self, batches: int) -> list[dict]:
        """Moves the cursor past `batches` global batches without reading them (a rollback
        skipping the data that made the loss spike): the same on every rank, whatever W.
        Returns what was skipped as ranges of positions in each epoch's order,
        [{"epoch", "start", "end"}, ...] (end exclusive)."""
        ranges: list[dict] = []
        for _ in range(batches):
            start = self._advance()
            if ranges and ranges[-1]["epoch"] == self.epoch and ranges[-1]["end"] == start:
                ranges[-1]["end"] = self.consumed
            else:
                ranges.append({"epoch": self.epoch, "start": start, "end": self.consumed})
        return ranges

    def _micro_batches(self, step: np.ndarray) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        b, W = self.micro_batch, self.world_size
        for m in range(self.accum_steps):
            start = (m * W + self.rank) * b
            began = time.monotonic()
            buf, mask = read_rows(self.stream, step[start:start + b], b, self.device)
            self.read_s += time.monotonic() - began
            yield _to_device(buf, self.device, mask)

    def state_dict(self) -> dict:
        return {"version": STATE_VERSION, "epoch": self.epoch, "consumed": self.consumed,
                "seed": self.seed, "seq_len": self.seq_len, "shuffle": self.shuffle,
                "num_windows": self.stream.num_windows, "order": self.order_version,
                "align": self.align}

    def load_state_dict(self, state: dict) -> None:
        """Continues from a saved cursor; W and A may differ from the saving run's."""
        state = {"align": "stream", **state}  # saved before data.align existed: the stream's
        for key in ("seed", "seq_len", "shuffle", "align"):  # data.seed, .seq_len, .shuffle, .align
            if state[key] != getattr(self, key):
                flag = f"--data.{key.replace('_', '-')}"
                value = f"{flag} {str(state[key]).lower()}"
                raise DataError(f"the checkpoint's data order was read with data.{key} = "
                                f"{state[key]}, this run has {getattr(self, key)}: resume with "
                                f"{value} (the order cannot change mid-run), or start a new "
                                "--run-dir")
        if state["num_windows"] != self.stream.num_windows:
            raise DataError(f"loader state counts {state['num_windows']} windows but the dataset "
                            f"has {self.stream.num_windows}: the data changed; resume on the same "
                            "dataset")
        self.epoch, self.consumed = int(state["epoch"]), int(state["consumed"])
        version = int(state.get("order", 1))  # saved before it was recorded: 1
        if version not in orders.VERSIONS:
            raise DataError(f"the checkpoint's data order is version {version}, newer than this "
                            "ddpgpt reads; upgrade ddpgpt (pip install -U ddpgpt)")
        self.order_version, self._order = version, None
        self.fetched_until = 0


SAMPLE_EPOCH = 2**31 - 1  # the training sample's order: an epoch no run reaches


def sample_windows(num_windows: int, count: int, seed: int) -> np.ndarray:
    """`count` of a split's windows drawn by `seed` (all of them if it has no more), sorted: the
    first `count` positions of the order of epoch SAMPLE_EPOCH, the same at any W and resume."""
    if count >= num_windows:
        return np.arange(num_windows)
    return np.sort(orders.epoch_order(num_windows, seed, SAMPLE_EPOCH).items(0, count))


class EvalLoader:
    """A fixed, deterministic list of windows (validation; a sample of training), split across
    ranks.

    Windows (data.align's rows: of the stream, or packed from documents): all of the split's, or
    `max_windows` of them evenly spaced, or with `sample_seed` `max_windows` drawn by that seed
    (sample_windows: train_eval_loss). Rank r takes windows
    r, r+W, r+2W, ...; every rank yields the same number of batches (the last rows of a short
    rank are padding whose targets are -1, which the loss ignores), so a collective inside the
    model's forward could never wait on a rank that ran out. Summing (loss · tokens, tokens)
    over ranks gives exactly the single-process token-weighted mean, up to float rounding.
    """

    def __init__(self, dataset: TokenDataset, *, seq_len: int, micro_batch: int,
                 world_size: int = 1, rank: int = 0, max_windows: int = 0, split: str = "val",
                 device: str | torch.device = "cpu", sample_seed: int | None = None,
                 align: str = "stream", cache: str = ""):
        self.stream = row_source(dataset, split, seq_len, align, cache)
        n = self.stream.num_windows
        if n == 0:
            raise DataError(f"dataset {dataset.path}: the {split} split has fewer than "
                            f"{seq_len + 1} tokens; re-run ddpgpt prepare with a larger "
                            "--val-fraction or use a smaller data.seq_len")
        if sample_seed is not None:
            self.windows = sample_windows(n, max_windows or n, sample_seed)
        else:
            self.windows = np.arange(n) if not max_windows or max_windows >= n else \
                np.linspace(0, n - 1, max_windows).round().astype(np.int64)
        self.micro_batch, self.seq_len = micro_batch, seq_len
        self.device = torch.device(device)
        self.mine = self.windows[rank::world_size]
        per_rank = -(-len(self.windows) // world_size)
        self.num_batches = -(-per_rank // micro_batch)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        b = self.micro_batch
        self.stream.prefetch(self.mine[:2 * b])
        for i in range(self.num_batches):
            ids = self.mine[i * b:(i + 1) * b]
            self.stream.prefetch(self.mine[(i + 2) * b:(i + 3) * b])  # two batches ahead
            buf, mask = read_rows(self.stream, ids, b, self.device)
            buf.numpy()[len(ids):] = 0
            if mask is not None:
                mask.numpy()[len(ids):] = 1
            x, y = _to_device(buf, self.device, mask)
            if len(ids) < b:  # padding rows: any input, no targets
                y = y.clone()
                y[len(ids):] = -1
            yield x, y

"""Units' token files -> the dataset's train and val shards, in unit order, resumably.

The assembler takes finished units in index order and appends each document (end-of-text, then
its tokens) to the train or val shards: document i goes to val when `is_val(i)` says so, whatever
unit or part it came in. Its whole state is a few counters and the shards' lengths, saved in
`progress.json` (`state_dict`); resuming truncates each open shard to the length recorded there,
so the bytes written after the last save are dropped and written again, identically.

A corpus of too few documents for the document split (nanoGPT's `input.txt`, a single book: one
document goes to val whole) is split by token position instead when it is finished: the last
`val_fraction` of the stream is the validation split.

Conversations (data/chat.py) come with a loss mask per token: the assembler writes it to mask
shards beside the token shards, cut at the same places (shards.py).
"""

from __future__ import annotations

import math
from dataclasses import asdict
from pathlib import Path

import numpy as np

from ddpgpt.data.formats.base import UnitStats
from ddpgpt.data.shards import MAGIC, MASK_MAGIC, ShardInfo, ShardWriter
from ddpgpt.errors import UserError
from ddpgpt.files import move

COPY_TOKENS = 1 << 20  # tokens copied at a time: memory stays bounded by this, not a document


def is_val(index: int, fraction_ppm: int) -> bool:
    """Document `index` goes to validation: ceil(n·f) of the first n documents do, evenly spaced,
    starting with document 0, so even a corpus of two documents gets one in each split."""
    def ceil_div(a: int) -> int:
        return -(-a // 1_000_000)
    return ceil_div((index + 1) * fraction_ppm) > ceil_div(index * fraction_ppm)


class SplitWriter:
    """Appends tokens to `{split}_NNNNNN.bin` shards of at most `shard_tokens` tokens each
    (`mask`: a loss mask to `{split}_NNNNNN.mask` mask shards)."""

    def __init__(self, out_dir: Path, split: str, dtype: str, shard_tokens: int,
                 mask: bool = False):
        self.out_dir, self.split, self.dtype = out_dir, split, dtype
        self.shard_tokens = shard_tokens
        self.ext, self.magic = ("mask", MASK_MAGIC) if mask else ("bin", MAGIC)
        self.infos: list[ShardInfo] = []
        self._writer: ShardWriter | None = None

    @property
    def tokens(self) -> int:
        return sum(i.tokens for i in self.infos) + (self._writer.count if self._writer else 0)

    def write(self, tokens: np.ndarray) -> None:
        while len(tokens):
            if self._writer is None:
                name = f"{self.split}_{len(self.infos):06d}.{self.ext}"
                self._writer = ShardWriter(self.out_dir / name, self.dtype, self.magic)
            room = self.shard_tokens - self._writer.count
            self._writer.write(tokens[:room])
            tokens = tokens[room:]
            if self._writer.count == self.shard_tokens:
                self.infos.append(self._writer.close())
                self._writer = None

    def close(self) -> list[ShardInfo]:
        if self._writer is not None:
            self.infos.append(self._writer.close())
            self._writer = None
        return self.infos

    def sync(self) -> None:
        if self._writer is not None:
            self._writer.sync()

    def state_dict(self) -> dict:
        return {"closed": [asdict(i) for i in self.infos],
                "open": self._writer.count if self._writer else None}

    def load_state_dict(self, state: dict) -> None:
        self.infos = [ShardInfo(**i) for i in state["closed"]]
        if state["open"] is not None:
            name = f"{self.split}_{len(self.infos):06d}.{self.ext}"
            self._writer = ShardWriter.reopen(self.out_dir / name, self.dtype, state["open"],
                                              self.magic)


class Assembler:
    """Builds the shards from units in order (see the module docstring)."""

    def __init__(self, out: Path, dtype: str, shard_tokens: int, val_fraction: float,
                 max_tokens: int = 0, masked: bool = False):
        self.out, self.dtype = out, dtype
        self.ppm = round(val_fraction * 1_000_000)
        self.val_fraction = val_fraction
        self.max_tokens = max_tokens
        self.writers = {s: SplitWriter(out, s, dtype, shard_tokens) for s in ("train", "val")}
        self.masks = {s: SplitWriter(out, s, "uint8", shard_tokens, mask=True)
                      for s in ("train", "val")} if masked else None
        self.trained = {"train": 0, "val": 0}  # tokens whose mask is 1 (conversations)
        self.units = 0  # units appended
        self.documents = {"train": 0, "val": 0}
        self.bytes = {"train": 0, "val": 0}
        self.stats = UnitStats()
        self.split = "train"  # of the document being written (continued by a next unit)
        self.full = False  # --max-tokens reached
        self.whole = (0, 0)  # (units, tokens) after the last unit added whole: the rate so far

    @property
    def tokens(self) -> int:
        return sum(w.tokens for w in self.writers.values())

    def add(self, tokens: np.ndarray, record: dict, mask: np.ndarray | None = None) -> None:
        """Appends one unit: `record["docs"]` lists each document's (tokens, bytes) in `tokens`
        (`mask`: their loss mask, conversations'), each to the split is_val gives it, or all to
        `record["split"]` (a unit of one split: the built-in conversations'); an llm.c unit
        instead names the split all its tokens go to."""
        self.units += 1
        self.stats.add(record.get("stats", {}))
        if record.get("split") and "docs" not in record:  # llm.c: no documents, bytes unknown
            self._write(record["split"], tokens)
        start = 0
        for n_tokens, n_bytes in record.get("docs", ()):
            if self.full:
                break
            self.split = record.get("split") or \
                ("val" if is_val(sum(self.documents.values()), self.ppm) else "train")
            self.documents[self.split] += 1
            self.bytes[self.split] += n_bytes
            self._write(self.split, tokens[start:start + n_tokens],
                        None if mask is None else mask[start:start + n_tokens])
            start += n_tokens
        self.whole = (self.units, self.tokens)

    def _write(self, split: str, tokens: np.ndarray, mask: np.ndarray | None = None) -> None:
        if self.max_tokens:
            room = self.max_tokens - self.tokens
            self.full = len(tokens) >= room
            tokens = tokens[:room]
        for start in range(0, len(tokens), COPY_TOKENS):
            self.writers[split].write(tokens[start:start + COPY_TOKENS])
            if self.masks is not None:  # the same span of the mask
                span = mask[start:min(start + COPY_TOKENS, len(tokens))]
                self.masks[split].write(span)
                self.trained[split] += int(np.count_nonzero(span))

    def sync(self) -> None:
        for w in self._all_writers():
            w.sync()

    def _all_writers(self) -> list[SplitWriter]:
        return [*self.writers.values(), *(self.masks or {}).values()]

    def finish(self, decode_bytes) -> tuple[dict, str | None]:
        """Closes the shards; returns them by split and a note when the split was by token
        position. `decode_bytes(ids)`: the UTF-8 bytes the ids stand for. The mask shards:
        `mask_infos` after it."""
        note = None
        if self.documents["train"] == 0 and self.documents["val"] > 0:
            if self.masks is not None:
                raise UserError(f"{self.documents['val']} conversation: too few to split into "
                                "train and val (one goes to each); give at least two")
            note = self._split_by_position(decode_bytes)
        if self.masks is not None:
            self.mask_infos = {s: w.close() for s, w in self.masks.items()}
        return {s: w.close() for s, w in self.writers.items()}, note

    def _split_by_position(self, decode_bytes) -> str:
        """All documents went to val (too few of them): the last val_fraction of the stream is
        val, the rest train, the stream unchanged."""
        infos = self.writers["val"].close()
        total = sum(i.tokens for i in infos)
        n_val = max(1, math.ceil(total * self.val_fraction))
        moved = []
        for info in infos:  # out of the way of the new val shards
            path = self.out / info.file
            moved.append(move(path, path.with_name("old_" + info.file)))
        self.writers = {s: SplitWriter(self.out, s, self.dtype, self.writers["val"].shard_tokens)
                        for s in ("train", "val")}
        stream = [np.memmap(p, dtype=self.dtype, mode="r", offset=1024) for p in moved]
        pos, val_ids = 0, []
        for part in stream:
            for start in range(0, len(part), COPY_TOKENS):
                block = part[start:start + COPY_TOKENS]
                cut = min(max(total - n_val - pos, 0), len(block))
                self.writers["train"].write(block[:cut])
                self.writers["val"].write(block[cut:])
                if cut < len(block):
                    val_ids.append(np.array(block[cut:]))
                pos += len(block)
        for path in moved:
            path.unlink()
        docs = self.documents["val"]
        self.documents = {"train": docs, "val": 0}
        val_bytes = len(decode_bytes(np.concatenate(val_ids)))
        self.bytes = {"train": self.bytes["val"] - val_bytes, "val": val_bytes}
        return (f"{docs} document{'s' if docs > 1 else ''}: too few to split by document, so the "
                f"last {self.val_fraction:g} of the tokens ({n_val:,}) are the validation split")

    def state_dict(self) -> dict:
        return {"units": self.units, "documents": dict(self.documents),
                "bytes": dict(self.bytes), "stats": asdict(self.stats), "full": self.full,
                "writers": {s: w.state_dict() for s, w in self.writers.items()},
                **({"masks": {s: w.state_dict() for s, w in self.masks.items()},
                    "trained": dict(self.trained)} if self.masks is not None else {})}

    def load_state_dict(self, state: dict) -> None:
        self.units, self.full = state["units"], state["full"]
        self.documents, self.bytes = dict(state["documents"]), dict(state["bytes"])
        self.stats = UnitStats(**state["stats"])
        for s, w in self.writers.items():
            w.load_state_dict(state["writers"][s])
        for s, w in (self.masks or {}).items():
            w.load_state_dict(state["masks"][s])
        self.trained = dict(state.get("trained", self.trained))
        self.whole = (self.units, self.tokens)

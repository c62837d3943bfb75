"""llm.c / modded-nanogpt shards, taken as tokens: recognised by their header (256 int32: magic
20240520, version 1, token count; then uint16 GPT-2 tokens), checked against their size when
planned, and every token checked to be a GPT-2 id before any is written. Each shard is one unit,
all of whose tokens go to the split its name says. They are tokens already: no tokenizer,
vocabulary, text field or val fraction applies to them (`refuses`), and they cannot share a
dataset with text to encode.

llm.c names its shards `NAME_train_NNNNNN.bin` and `NAME_val_NNNNNN.bin` (`TinyStories_val.bin`,
`fineweb_val_000000.bin`): a shard is val when one of the words of its name, cut at `_`, `-` and
`.`, is `val`; a name that merely contains the letters (`interval_train_000001.bin`) is train.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from ddpgpt.data.formats.base import Format, Unit, read_head
from ddpgpt.errors import UserError

MAGIC, VERSION = 20240520, 1
VOCAB, EOT = 50257, 50256  # GPT-2's vocabulary: the ids an llm.c shard may hold; end-of-text
HEADER_BYTES = 256 * 4
CHECK_TOKENS = 1 << 24  # tokens checked at a time


def split_of(name: str) -> str:
    """"val" for a shard whose name has the word val, else "train"."""
    return "val" if "val" in re.split(r"[_.\-]", name.lower()) else "train"


def check_ids(path: str, tokens: np.ndarray) -> None:
    """One line naming the file and the offset of the first token that is no GPT-2 id (training
    would index past the embedding)."""
    for start in range(0, len(tokens), CHECK_TOKENS):
        block = tokens[start:start + CHECK_TOKENS]
        bad = np.flatnonzero(block >= VOCAB)
        if len(bad):
            at = start + int(bad[0])
            raise UserError(f"{path}: token {at:,} (byte offset {HEADER_BYTES + 2 * at:,}) is "
                            f"{int(block[bad[0]])}, not a GPT-2 id (below {VOCAB}): not an llm.c "
                            "GPT-2 shard; convert it with a GPT-2 tokenizer or remove it from the "
                            "sources")


def tokens(path: Path, size: int) -> int:
    """An llm.c shard's token count, after checking its header against its size."""
    head = np.frombuffer(read_head(path, HEADER_BYTES).ljust(12, b"\0"), dtype="<i4")
    if size < HEADER_BYTES:
        raise UserError(f"{path}: truncated llm.c shard ({size} bytes, shorter than its "
                        f"{HEADER_BYTES}-byte header); download it again")
    if head[1] != VERSION:
        raise UserError(f"{path}: llm.c shard version {head[1]}, expected {VERSION} "
                        "(uint16 GPT-2 tokens); convert it or remove it from the sources")
    count, expected = int(head[2]), HEADER_BYTES + 2 * int(head[2])
    if size != expected:
        what = "truncated" if size < expected else "has trailing bytes"
        raise UserError(f"{path}: llm.c shard {what}: its header says {count} tokens "
                        f"({expected} bytes) but the file has {size} bytes; download it again")
    return count


def array(path: str) -> np.ndarray:
    """An llm.c shard's tokens as a read-only memory map."""
    count = int(np.fromfile(path, dtype="<i4", count=3)[2])
    if count == 0:
        return np.zeros(0, dtype=np.uint16)
    return np.memmap(path, dtype="<u2", mode="r", offset=HEADER_BYTES, shape=(count,))


class Llmc(Format):
    name = "llmc"
    tokens = True
    refuses = ("tokenizer_from", "text_field", "skip_bad_rows", "vocab_size", "bpe_train_mb",
               "val_fraction")
    tokenizer, vocab_size, eot_id = "gpt2", VOCAB, EOT  # what the tokens are
    identity = "gpt2 (llm.c shards)"  # the tokenizer, as settings.json records it
    described = "llm.c shards, GPT-2 tokens already and split by their names (*_val_*)"
    split_by = "llm.c files"  # meta.json's source.split
    units_named = "llm.c shards"  # the summary's count of units

    def claims(self, path: Path) -> bool:
        return path.name.lower().endswith(".bin") and \
            read_head(path, 4) == np.int32(MAGIC).tobytes()

    def plan_file(self, path: Path, size: int, record: dict, text_field: str) -> list[Unit]:
        split = split_of(path.name)  # the word val, not the letters
        record["tokens"] = tokens(path, size)
        record["split"] = split
        return [Unit(self.name, (str(path),), split=split)]

    def array(self, unit: Unit) -> np.ndarray:
        """The unit's tokens, every one checked to be a GPT-2 id."""
        out = array(unit.paths[0])
        check_ids(unit.paths[0], out)  # before any of its tokens is written
        return out

    def empty_split(self, split: str, specs: list[str]) -> str:
        """The line for a split that no shard's name put anything in."""
        has = "is named as a val shard" if split == "val" else "is named as a train shard"
        return (f"the {split} split is empty: no llm.c shard of {' '.join(specs)} {has} "
                "(val: the word val in its name, as llm.c's *_val_*.bin); give train and val "
                "shards")

    def refuse_mix(self, shard: str, other: str) -> None:
        """The sources hold a shard and `other`, something else: one line."""
        if str(other).endswith(".bin"):
            head = read_head(Path(other), 4)
            magic = int.from_bytes(head, "little") if len(head) == 4 else None
            raise UserError(f"{other}: not an llm.c shard (magic {magic}, expected {MAGIC}) "
                            f"among the llm.c shards of the sources ({shard}); remove it from "
                            "them")
        raise UserError(f"the sources mix llm.c shards ({shard}) with text ({other}); the shards "
                        "are tokens already: prepare them apart from the text")


ROW = Llmc()

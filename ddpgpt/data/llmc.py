"""What prepare checks of llm.c / modded-nanogpt shards beyond their header (formats.py reads
them): which split a shard's name puts it in, and that every token is a GPT-2 id.

llm.c names its shards `NAME_train_NNNNNN.bin` and `NAME_val_NNNNNN.bin` (`TinyStories_val.bin`,
`fineweb_val_000000.bin`): a shard is val when one of the words of its name, cut at `_`, `-` and
`.`, is `val`; a name that merely contains the letters (`interval_train_000001.bin`) is train.
"""

from __future__ import annotations

import re

import numpy as np

from ddpgpt.errors import UserError

VOCAB = 50257  # GPT-2's vocabulary: the ids an llm.c shard may hold
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

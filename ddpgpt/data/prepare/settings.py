"""Which of `prepare`'s settings a job uses: each setting given is applied or refused in one line,
never silently ignored. A setting counts as given when it differs from its default.

- `--merge` assembles the parts' encoded units: the tokenizer, the text field, the rows skipped
  and the encoding's workers were the parts' (refused here), and `--val-fraction` /
  `--shard-tokens`, which only the assembly uses, are the parts' unless the merge gives its own
  (a merge and parts that both give one, differently, are refused).
- A format declares the settings that do not apply to it (its row's `refuses`, formats/):
  sources all of that format refuse them. llm.c shards are GPT-2 tokens already, split by their
  names: no tokenizer, vocabulary, text field or val fraction applies to them.
- `--vocab-size` and `--bpe-train-mb` shape the bpe tokenizer that prepare trains; with `byte`,
  `gpt2` or `--tokenizer-from` nothing is trained.
"""

from __future__ import annotations

import dataclasses

from ddpgpt.config.commands import PrepareConfig
from ddpgpt.data.formats.base import Format
from ddpgpt.errors import UserError

DEFAULTS = {f.name: f.default for f in dataclasses.fields(PrepareConfig)
            if f.default is not dataclasses.MISSING}
PARTS_ONLY = ("tokenizer", "tokenizer_from", "text_field", "skip_bad_rows", "vocab_size",
              "bpe_train_mb", "workers", "chat", "strict")
BPE_ONLY = ("vocab_size", "bpe_train_mb")


def given(cfg: PrepareConfig, names) -> list[str]:
    """The settings among `names` that differ from their defaults, as flags with their values."""
    return [_flag(name, getattr(cfg, name)) for name in names
            if getattr(cfg, name) != DEFAULTS[name]]


def _flag(name: str, value) -> str:
    flag = f"--{name.replace('_', '-')}"
    return flag if value is True else f"{flag} {value}"


def check_merge(cfg: PrepareConfig) -> None:
    extra = given(cfg, PARTS_ONLY)
    if extra:
        raise UserError(f"--merge assembles the parts' encoded units: {', '.join(extra)} "
                        f"{'does' if len(extra) == 1 else 'do'} not apply to it (the tokenizer, "
                        "text field and workers were the parts'); drop "
                        f"{'it' if len(extra) == 1 else 'them'}")


def merged(cfg: PrepareConfig, parts: dict) -> PrepareConfig:
    """The merge's settings: its own --val-fraction and --shard-tokens where given, else those
    the parts were prepared with (`parts`: their recorded settings)."""
    values = {}
    for name in ("val_fraction", "shard_tokens"):
        mine, theirs = getattr(cfg, name), parts.get(name, DEFAULTS[name])
        if mine != DEFAULTS[name] and theirs != DEFAULTS[name] and mine != theirs:
            raise UserError(f"--merge {_flag(name, mine)}: the parts were prepared with "
                            f"{_flag(name, theirs)}; give one of them (or none: the parts' "
                            "applies)")
        values[name] = mine if mine != DEFAULTS[name] else theirs
    return dataclasses.replace(cfg, **values)


def check_sources(cfg: PrepareConfig, rows: list[Format]) -> None:
    """Settings the sources' formats (`rows`, each once) would ignore: those that every one of
    them refuses (llm.c shards take none of the tokenizer's or the split's, nor a --tokenizer
    but the one their tokens are of); only a bpe trained here takes a vocabulary size and a
    training budget."""
    refused = [n for n in (rows[0].refuses if rows else ()) if all(n in r.refuses for r in rows)]
    extra = given(cfg, refused)
    tokens = rows[0] if len(rows) == 1 and rows[0].tokens else None
    if tokens is not None and cfg.tokenizer not in (DEFAULTS["tokenizer"], tokens.tokenizer):
        extra.insert(0, _flag("tokenizer", cfg.tokenizer))
    if extra:
        what = " and ".join(row.described for row in rows)
        raise UserError(f"the sources are {what}: {', '.join(extra)} "
                        f"{'does' if len(extra) == 1 else 'do'} not apply to them; drop "
                        f"{'it' if len(extra) == 1 else 'them'}")
    if tokens is not None:
        return
    if cfg.tokenizer_from is not None and cfg.tokenizer != DEFAULTS["tokenizer"]:
        raise UserError(f"--tokenizer {cfg.tokenizer} and --tokenizer-from {cfg.tokenizer_from} "
                        "contradict each other: --tokenizer-from takes that dataset's tokenizer; "
                        "give one of them")
    if cfg.tokenizer != "bpe" or cfg.tokenizer_from is not None:
        extra = given(cfg, BPE_ONLY)
        what = f"--tokenizer-from {cfg.tokenizer_from}" if cfg.tokenizer_from is not None \
            else f"--tokenizer {cfg.tokenizer}"
        if extra:
            raise UserError(f"{', '.join(extra)} shape{'s' if len(extra) == 1 else ''} the bpe "
                            f"tokenizer prepare trains, and {what} trains none; drop "
                            f"{'it' if len(extra) == 1 else 'them'}")

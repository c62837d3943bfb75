"""The end of a prepare: a dataset's last checks, its meta.json (written last: it marks the
dataset complete) and its summary, or a part's part.json."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from ddpgpt import __version__
from ddpgpt.config.commands import PrepareConfig
from ddpgpt.data import chat
from ddpgpt.data.prepare.assemble import Assembler
from ddpgpt.data.prepare.build import Build
from ddpgpt.data.shards import META_FORMAT_VERSION, ShardInfo
from ddpgpt.data.verify import record_shards
from ddpgpt.errors import UserError, warn

ORDER = "sources in the order given, files sorted by path, rows in file order"
PART_FILE = "part.json"


def finish_dataset(cfg: PrepareConfig, job: dict, tok, dtype: str, tmp: Path, build: Build):
    asm = build.asm
    tokens = job["plan"].tokens  # the format whose tokens the units are, or None
    job["read"] = True  # all of the corpus: an error from here leaves nothing to continue
    _check_documents(cfg, job, asm)
    if not tokens and asm.documents["train"] == 0:
        build.restart_assembly()  # the split by position rewrites the shards
    shards, note = asm.finish(None if tokens else tok.decode_bytes)
    masks = asm.mask_infos if asm.masks is not None else None
    record_shards(tmp, {**shards, **{f"{k} masks": v for k, v in (masks or {}).items()}})
    # (hashed as written: a training start need not hash them again)
    for split in ("train", "val"):
        if not shards[split] or not sum(i.tokens for i in shards[split]):
            raise UserError(tokens.empty_split(split, job["specs"]) if tokens else
                            _empty_split(split))
    split_how = tokens.split_by if tokens else "tokens" if note else "documents"
    source = {"specs": job["specs"], "order": ORDER, "files": job["plan"].files,
              "val_fraction": cfg.val_fraction, "split": split_how,
              "text_field": job.get("text_field", cfg.text_field), "max_tokens": cfg.max_tokens,
              "stats": _stats(asm)}
    if masks is not None:
        source["trained_tokens"] = dict(asm.trained)
    meta = make_meta(tok, dtype, shards, source, None if tokens else asm.bytes, masks)
    if not tokens:
        tok.save(tmp)
    build.clean()
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")  # last: marks complete
    return _summary(meta, asm, tok, note, tokens)


def _stats(asm: Assembler) -> dict:
    stats = asdict(asm.stats)
    stats.update(train_documents=asm.documents["train"], val_documents=asm.documents["val"])
    stats["documents"] = stats["train_documents"] + stats["val_documents"]
    return stats


def _check_documents(cfg: PrepareConfig, job: dict, asm: Assembler) -> None:
    if job["plan"].tokens or sum(asm.documents.values()):
        return
    s = asm.stats
    if asm.masks is not None:
        raise UserError(f"no conversations in {' '.join(job['specs'])}: {skipped_records(s)}; "
                        "give records whose messages hold an assistant turn")
    bad = f", {s.bad_rows} bad rows" if s.bad_rows else ""
    raise UserError(f"no documents in {' '.join(job['specs'])} ({s.skipped_binary} binary "
                    f"and {s.skipped_empty} empty files skipped{bad}); give a source with text")


def _empty_split(split: str) -> str:
    return (f"the {split} split is empty (--max-tokens or --val-fraction too small for this "
            "corpus); give more data or change them")


def finish_part(cfg: PrepareConfig, job: dict, tok, tmp: Path, build: Build):
    """A part: its units' files stay, with part.json to say what they are."""
    plan = job["plan"]
    record = {"part": list(cfg.part_of), "specs": job["specs"], "files": plan.files,
              "plan_units": [asdict(u) for u in plan.units], "text_bytes": plan.text_bytes,
              "tokenizer": tok.kind, "identity": job["tok"]["identity"],
              "settings": {k: v for k, v in job["settings"].items()
                           if k not in ("part", "stamps")}}
    tok.save(tmp)
    for name in ("progress.json", "settings.json", "lock"):
        (tmp / name).unlink(missing_ok=True)
    (tmp / PART_FILE).write_text(json.dumps(record) + "\n")
    owned, n_units = build.owned, len(plan.units)
    return lambda out, seconds, size: (
        f"prepared part {cfg.part} into {out}: units {owned.start}..{owned.stop - 1} of "
        f"{n_units} in {seconds:.1f} s; output {size:.1f} MB; when every part is done: ddpgpt "
        "prepare --merge PART_DIRS --out DIR")


def skipped_records(s) -> str:
    """What the records that were not conversations were, counted (UnitStats)."""
    counts = [(getattr(s, key), why) for key, why in chat.REASONS.items() if getattr(s, key)]
    total = sum(n for n, _ in counts)
    if not total:
        return "every record was a conversation"
    return (f"skipped {total:,} record{'s' if total > 1 else ''} that are not conversations ("
            + "; ".join(f"{n:,}: {why}" for n, why in counts) + "; --strict refuses them)")


def make_meta(tok, dtype: str, shards: dict[str, list[ShardInfo]], source: dict,
              split_bytes: dict[str, int] | None = None,
              masks: dict[str, list[ShardInfo]] | None = None) -> dict:
    """The contents of a dataset's meta.json (read back by `shards.TokenDataset`). `bytes`: each
    split's UTF-8 bytes of text, which with its token count turns a loss per token into bits
    per byte (datasets prepared before it, and from llm.c shards, lack it). `masks`: the loss
    mask shards of conversations (then format version 2, and the chat template's name)."""
    meta = {
        "format_version": META_FORMAT_VERSION if masks is not None else 1,
        "tokenizer": tok.kind,
        "vocab_size": tok.vocab_size,
        "eot_id": tok.eot_id,
        "dtype": dtype,
        "shards": {s: [asdict(i) for i in infos] for s, infos in shards.items()},
        "source": source,
        "created_by": f"ddpgpt {__version__}",
    }
    if split_bytes is not None:
        meta["bytes"] = dict(split_bytes)
    if masks is not None:
        meta["masks"] = {s: [asdict(i) for i in infos] for s, infos in masks.items()}
        meta["chat"] = {"template": chat.TEMPLATE}
    return meta


FEW_VAL_DOCUMENTS = 10  # fewer in the val split: its loss is that of a handful of documents


def _summary(meta: dict, asm: Assembler, tok, note: str | None, row):
    """The summary, as a function of --out, the seconds taken and the output's MB."""
    tokens = {s: sum(i["tokens"] for i in meta["shards"][s]) for s in ("train", "val")}
    total = tokens["train"] + tokens["val"]
    s, docs = asm.stats, asm.documents
    n_docs = docs['train'] + docs['val']
    named = "conversation" if asm.masks is not None else "document"
    what = (f"{n_docs:,} {named}{'s' if n_docs != 1 else ''} ({docs['train']:,} train, "
            f"{docs['val']:,} val)" if row is None
            else f"{asm.units} {row.units_named}")
    extra = []
    if asm.masks is not None:
        trained = sum(asm.trained.values())
        extra.append(f"{trained:,} of the {sum(tokens.values()):,} tokens are the assistant's "
                     f"(the loss mask's 1s); {skipped_records(s)}")
    if s.bad_rows:
        extra.append(f"skipped {s.bad_rows:,} bad rows (--skip-bad-rows)")
    if s.null_rows:
        extra.append(f"skipped {s.null_rows:,} null rows (no text)")
    if s.replaced:
        extra.append(f"replaced {s.replaced:,} invalid UTF-8 sequences by U+FFFD")
    if note:
        extra.append(f"split by token position: {note}")
    if asm.full:
        extra.append(f"stopped at --max-tokens {asm.max_tokens:,}")
    few = row is None and not note and docs["val"] < FEW_VAL_DOCUMENTS

    def text(out: Path, seconds: float, size: float) -> str:
        if few:  # said last, on stderr, after the work's own lines
            warn(f"the val split is {docs['val']} document{'s' if docs['val'] > 1 else ''} "
                 f"(--val-fraction {asm.val_fraction:g} of {n_docs:,}): its loss is theirs "
                 "alone and says little of the rest; a larger --val-fraction holds out more")
        return "\n".join([
            f"prepared {out}: {what}, {total:,} tokens ({tokens['train']:,} train, "
            f"{tokens['val']:,} val), {meta['tokenizer']} vocab {meta['vocab_size']}",
            f"skipped {s.skipped_binary} binary and {s.skipped_empty} empty files; "
            f"{s.text_bytes / 1e6:.1f} MB of text in {seconds:.1f} s "
            f"({total / max(seconds, 1e-9) / 1e6:.2f}M tokens/s); output {size:.1f} MB",
            *extra])
    return text

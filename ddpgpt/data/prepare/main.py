"""`ddpgpt prepare`: turn a corpus into token shards that training processes memory-map.

    ddpgpt prepare --out data/stdlib                  # the Python standard library, bpe 4096
    ddpgpt prepare notes/ 'books/**/*.txt' --out data/mine --tokenizer byte
    ddpgpt prepare 'fineweb-edu/sample/10BT/*.parquet' --tokenizer gpt2 --out data/edu10b
    ddpgpt prepare 'dump/*.jsonl.zst' --text-field content --tokenizer gpt2 --out data/dump
    ddpgpt prepare 'edu_fineweb10B/*.bin' --out data/edu   # llm.c shards, taken as tokens
    ddpgpt prepare hf:roneneldan/TinyStories --out data/ts --tokenizer gpt2   # needs the hf extra
    ddpgpt prepare SOURCES --part 3/8 --tokenizer gpt2 --out parts/3   # then, once all 8 exist:
    ddpgpt prepare --merge 'parts/*' --out data/edu10b
    ddpgpt prepare --verify data/stdlib                # re-hash every shard against meta.json
    ddpgpt prepare chats.jsonl --chat --tokenizer-from runs/base --out data/chat  # conversations

Each text file, jsonl line or parquet row is one document, in a fixed order (sources in the order
given, files sorted, rows in file order; meta.json lists the files). Text files: invalid UTF-8
is replaced (counted) for bpe and gpt2, kept exactly by the byte tokenizer; files with NUL bytes
are skipped as binary, empty ones as empty. Every document is preceded by the end-of-text token,
so the stream reads EOT doc EOT doc ... and a model sampled from EOT starts a fresh document.

The sources (sources.py) are cut into units by their formats (formats/table.py) that
`--workers` processes encode (units.py); the assembler appends them in order (assemble.py), so
the shards are the same for any number of workers, parts or interruptions. Output goes to
`.NAME.partial` beside `--out`, renamed to `--out` only when complete (output.py); an
interrupted prepare continues there (build.py); finish.py writes meta.json last. A document
longer than `formats.base.PIECE_CHARS` is read and encoded in pieces, cut before a word where it
can be (`base._cut_point`), so that memory stays bounded per document too. The bpe tokenizer is
trained first, on at most `bpe_train_mb` of the corpus.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from contextlib import ExitStack, suppress
from pathlib import Path
from types import SimpleNamespace

from ddpgpt.config.commands import PrepareConfig
from ddpgpt.data import chat, storage
from ddpgpt.data.formats import table
from ddpgpt.data.formats.base import Unit, UnitStats
from ddpgpt.data.formats.table import Plan
from ddpgpt.data.prepare import settings as settings_of
from ddpgpt.data.prepare import space, upload
from ddpgpt.data.prepare.assemble import Assembler
from ddpgpt.data.prepare.build import Build, check_settings, part_range
from ddpgpt.data.prepare.finish import PART_FILE, finish_dataset, finish_part
from ddpgpt.data.prepare.output import CleanExit, Lock, check_out, make_partial, partial_of, publish
from ddpgpt.data.prepare.sources import resolve_sources
from ddpgpt.data.shards import TokenDataset, dtype_for_vocab
from ddpgpt.data.tokenizer import (
    EOT_TEXT,
    BPETokenizer,
    TokenizerSpec,
    base_kind,
    fingerprint,
    folder_tokenizer,
    load_tokenizer,
    with_chat,
)
from ddpgpt.data.verify import check_all
from ddpgpt.errors import UserError


def run(cfg: PrepareConfig) -> None:
    if cfg.verify is not None:
        return verify(cfg.verify)
    if cfg.out is None:
        raise UserError("ddpgpt prepare needs --out DIR (or --verify DIR)")
    remote = cfg.out if storage.is_url(cfg.out) else None  # staged here, then uploaded
    if remote:
        upload.check_remote(remote, cfg.force)
    out = upload.staging(remote) if remote else Path(cfg.out)
    check_out(out, cfg.force)
    tmp = partial_of(out)
    cfg, job = _merge_job(cfg) if cfg.merge else (cfg, _source_job(cfg, out, tmp))
    if remote and upload.staged(tmp, job["settings"]):  # its upload was cut short: go on
        print(f"continuing the upload of {tmp} (prepared by an earlier run) to {remote}",
              flush=True)
        size = upload.publish(tmp, remote)
        shutil.rmtree(tmp, ignore_errors=True)
        print(f"prepared {remote}: {size:.1f} MB uploaded")
        return None
    start = time.perf_counter()
    made: list[Path] = []
    job["earlier"] = tmp.is_dir()  # a partial of an earlier run: never removed here
    with CleanExit(lambda: _stopped(tmp, out, job)) as signals, ExitStack() as stack:
        finished = locked = False
        try:
            make_partial(out, tmp, made)
            stack.enter_context(Lock(tmp, out))
            locked = True
            with space.reported(tmp, lambda: job.get("build")):
                summary = _build(cfg, job, tmp, out)
            if remote:  # uploaded whole, marker last; a cut upload is continued by a rerun
                upload.mark(tmp, job["settings"])
                stack.close()
                size = upload.publish(tmp, remote)
                finished = True
            else:
                finished = True
                check_out(out, cfg.force)
                signals.hold()  # from here the dataset is published whatever comes: a signal
                stack.close()  # (the lock goes with the partial's name)
                publish(tmp, out)  # between its two renames would lose the old --out
        finally:
            staged = remote and (tmp / upload.STAGED).is_file() and not finished
            if locked and not staged and (finished or job.get("read") or _nothing_done(job)):
                shutil.rmtree(tmp, ignore_errors=True)  # nothing to continue
            if not tmp.exists():
                for path in reversed(made):  # parents made for a run that leaves nothing
                    with suppress(OSError):  # behind; rmdir removes only empty directories
                        path.rmdir()
    if not remote:
        size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file()) / 1e6
    print(summary(remote or out, time.perf_counter() - start, size))


def _nothing_done(job: dict) -> bool:
    if job["earlier"]:
        return False
    return job.get("build") is None or job["build"].done == 0


def _stopped(tmp: Path, out: Path, job: dict) -> str:
    build = job.get("build")
    if _nothing_done(job):
        return (f"before prepare finished, with nothing done yet (--out {out} is unchanged); "
                "run the same command again to prepare it")
    done = f"{build.done} of {len(build.owned)} units done; " if build else ""
    return (f"before prepare finished; its progress is kept in {tmp} ({done}--out {out} is "
            "unchanged): run the same command again to continue")


# --- what is prepared --------------------------------------------------------------------


def _source_job(cfg: PrepareConfig, out: Path, tmp: Path) -> dict:
    """Sources -> plan, tokenizer and the settings that identify the prepare."""
    corpus = resolve_sources(cfg.sources or ["stdlib"], exclude=[out.resolve(), tmp.resolve()])
    if corpus.repeated:
        print(corpus.repeated_note(), file=sys.stderr)
    plan = table.plan(corpus, cfg.record_field, cfg.chat)
    settings_of.check_sources(cfg, plan.formats)
    tok = _tokenizer_choice(cfg, plan)
    if cfg.part_of is not None:
        if tok["kind"] == "bpe" and not cfg.tokenizer_from:
            raise UserError(f"--part {cfg.part} with --tokenizer bpe: each part would train its "
                            "own tokenizer; prepare one dataset first and pass --tokenizer-from "
                            "DIR, or use --tokenizer gpt2 or byte")
        if cfg.max_tokens:
            raise UserError(f"--part {cfg.part} with --max-tokens: the limit is on the whole "
                            "stream; give --max-tokens to the --merge instead")
    settings = {
        "sources": corpus.specs, "plan": table.plan_record(plan),
        "stamps": plan.stamps, "tokenizer": tok["identity"],
        "val_fraction": cfg.val_fraction, "shard_tokens": cfg.shard_tokens,
        "text_field": cfg.text_field, "skip_bad_rows": cfg.skip_bad_rows,
        "max_tokens": cfg.max_tokens, "part": cfg.part, "bpe_train_mb": cfg.bpe_train_mb,
        **({"chat": chat.TEMPLATE, "strict": cfg.strict} if cfg.chat else {}),
    }
    return {"plan": plan, "tok": tok, "settings": settings, "specs": corpus.specs,
            "chat": cfg.chat, "text_field": cfg.record_field}


def _tokenizer_choice(cfg: PrepareConfig, plan: Plan) -> dict:
    """kind, where its tokenizer.json comes from (bpe), and what identifies it."""
    if plan.tokens:  # tokens already: of the format's tokenizer
        return {"kind": plan.tokens.tokenizer, "dir": None, "identity": plan.tokens.identity}
    if cfg.tokenizer_from is not None:
        kind, directory = tokenizer_from(cfg.tokenizer_from)
        return {"kind": kind, "dir": directory, "identity": fingerprint(kind, directory)}
    identity = cfg.tokenizer if cfg.tokenizer != "bpe" else f"bpe trained, vocab {cfg.vocab_size}"
    return {"kind": cfg.tokenizer, "dir": None, "identity": identity}


def tokenizer_from(path: str) -> tuple[str, str | Path]:
    """The tokenizer kind of a prepared dataset (meta.json), a run (data_meta.json: its run dir,
    or the URL of its checkpoints) or a transformers directory (config.json: `ddpgpt export`'s,
    or GPT-2's), and the directory (or URL) that holds its tokenizer.json."""
    files = storage.open_dir(path)
    for name in ("meta.json", "data_meta.json"):
        if files.has(name):
            meta = files.where(name)
            try:
                kind = json.loads(files.read(name))["tokenizer"]
            except (ValueError, KeyError, TypeError):
                raise UserError(f"--tokenizer-from {path}: {meta} names no tokenizer; give a "
                                "prepared dataset or a run directory") from None
            if kind == "bpe" and not files.has("tokenizer.json"):
                raise UserError(f"--tokenizer-from {path}: no tokenizer.json beside {meta}; "
                                "give a prepared dataset or a run directory")
            return kind, path if files.remote else Path(path)
    if not files.remote and (Path(path) / "config.json").is_file():  # beside a model's weights
        return _weights_tokenizer(Path(path))
    raise UserError(f"--tokenizer-from {path}: neither a prepared dataset (meta.json), a run "
                    "directory (data_meta.json) nor a transformers directory (config.json); give "
                    "one of them")


def _weights_tokenizer(path: Path) -> tuple[str, Path]:
    """A transformers directory's tokenizer, as what `--init-from` that directory takes."""
    found = folder_tokenizer(path, f"--tokenizer-from {path}")
    kind = (found or "").partition(":")[0]
    if kind == "bpe" and (path / "tokenizer.json").is_file():
        if BPETokenizer.load(path).eot_id is not None:
            return kind, path
        raise UserError(f"--tokenizer-from {path}: its tokenizer.json has no {EOT_TEXT} token, "
                        "which ddpgpt's documents end with; give a tokenizer that has one")
    if base_kind(kind) in ("byte", "gpt2"):
        return kind, path
    raise UserError(f"--tokenizer-from {path}: no tokenizer ddpgpt reads beside the weights (a "
                    "tokenizer.json, or GPT-2's vocab.json); give a directory `ddpgpt export` "
                    "wrote, or a prepared dataset or run")


def _merge_job(cfg: PrepareConfig) -> tuple[PrepareConfig, dict]:
    """Part directories -> the plan they share, checked to be all N parts of one prepare; the
    merge's settings with the parts' split and shard size applied (prepare/settings.py)."""
    settings_of.check_merge(cfg)
    dirs = sorted({Path(m) for m in upload.fetch_parts(cfg.sources)})
    if not dirs:
        raise UserError("--merge needs the part directories of a --part I/N prepare as sources")
    parts = {}
    for d in dirs:
        try:
            part = json.loads((d / PART_FILE).read_text())
        except (OSError, ValueError):
            raise UserError(f"--merge: {d} is not a finished part (no {PART_FILE}); prepare it "
                            "with --part I/N first") from None
        parts[d] = part
    first = next(iter(parts.values()))
    n = first["part"][1]
    for d, part in parts.items():
        if {k: v for k, v in part.items() if k != "part"} != \
                {k: v for k, v in first.items() if k != "part"}:
            raise UserError(f"--merge: {d} is a part of another prepare (other sources or "
                            f"settings) than {dirs[0]}; merge the parts of one prepare")
    have = sorted(p["part"][0] for p in parts.values())
    if have != list(range(1, n + 1)):
        missing = sorted(set(range(1, n + 1)) - set(have))
        what = (f"parts {missing} of {n} are missing" if missing
                else f"a part is given twice ({have})")
        raise UserError(f"--merge: {what}; give each part directory once")
    cfg = settings_of.merged(cfg, first["settings"])
    units = [Unit(**{**u, "paths": tuple(u["paths"])}) for u in first["plan_units"]]
    plan = Plan(units, first["files"], first["text_bytes"])
    tok = {"kind": first["tokenizer"], "dir": dirs[0], "identity": first["identity"]}
    owners = {i: d / "units" for d, p in parts.items()
              for i in part_range(len(plan.units), tuple(p["part"]))}
    settings = {"merge": [str(d.resolve()) for d in dirs], "val_fraction": cfg.val_fraction,
                "shard_tokens": cfg.shard_tokens, "max_tokens": cfg.max_tokens}
    return cfg, {"plan": plan, "tok": tok, "settings": settings, "specs": first["specs"],
                 "owners": owners, "text_field": first["settings"]["text_field"],
                 "chat": bool(first["settings"].get("chat"))}


# --- the build -----------------------------------------------------------------------------


def _build(cfg: PrepareConfig, job: dict, tmp: Path, out: Path):
    """Everything between the partial's creation and its publication; returns the summary."""
    plan = job["plan"]
    resumed = check_settings(tmp, job["settings"], out)
    tok = _tokenizer(cfg, job, tmp)
    dtype = dtype_for_vocab(tok.vocab_size)
    part = cfg.part_of
    asm = None if part else Assembler(tmp, dtype, cfg.shard_tokens, cfg.val_fraction,
                                      cfg.max_tokens, masked=job["chat"])
    workers = cfg.workers or len(os.sched_getaffinity(0))
    spec = TokenizerSpec(tok.kind, str(tmp) if tok.kind == "bpe" else None)
    owned = part_range(len(plan.units), part) if part else None
    reading = chat.Reading(cfg.strict) if job["chat"] else None
    build = Build(tmp, plan, asm, workers, (spec, dtype, tmp / "units", job["text_field"],
                                            cfg.skip_bad_rows, reading), owned)
    build.sources, build.local_tok = job.get("owners", {}), tok
    job["build"] = build
    if resumed and build.done:
        print(f"continuing the prepare in {tmp}: {build.done} of {len(build.owned)} units done"
              + (f", {asm.tokens:,} tokens in the shards" if asm else ""), flush=True)
    build.run()
    if part:
        return finish_part(cfg, job, tok, tmp, build)
    return finish_dataset(cfg, job, tok, dtype, tmp, build)


def _tokenizer(cfg: PrepareConfig, job: dict, tmp: Path):
    """The tokenizer, with its tokenizer.json in the partial for bpe (trained once: a resumed
    prepare loads the one it trained); for conversations, with the chat template's tokens."""
    tok = _plain_tokenizer(cfg, job, tmp)
    if not job["chat"] or not chat.missing(tok.special):
        return tok
    tok = with_chat(tok)  # added after the tokenizer's own ids
    tok.save(tmp)  # a bpe's tokenizer.json, with them, for the workers and the dataset
    return tok


def _plain_tokenizer(cfg: PrepareConfig, job: dict, tmp: Path):
    info = job["tok"]
    row = job["plan"].tokens
    if row:  # the units are tokens already
        return SimpleNamespace(kind=row.tokenizer, vocab_size=row.vocab_size, eot_id=row.eot_id,
                               save=lambda d: None, special={})
    if info["dir"] is not None and base_kind(info["kind"]) == "bpe":
        if not (tmp / "tokenizer.json").is_file():  # whole (Directory.write: atomic_write)
            storage.Directory(tmp).write("tokenizer.json",
                                         storage.open_dir(info["dir"]).read("tokenizer.json"))
        return load_tokenizer(tmp, "bpe")
    if info["kind"] != "bpe":
        return TokenizerSpec(info["kind"])()
    if (tmp / "tokenizer.json").is_file():
        return load_tokenizer(tmp, "bpe")
    tok = BPETokenizer.train(_training_texts(job["plan"], cfg), cfg.vocab_size,
                             show_progress=sys.stderr.isatty(),
                             reserved=chat.TOKENS if job["chat"] else ())
    tok.save(tmp)  # atomically: a tokenizer.json in the partial is whole
    return tok


def _training_texts(plan: Plan, cfg: PrepareConfig):
    """The first `bpe_train_mb` of the corpus's text, in order: what the bpe is trained on."""
    limit, seen = cfg.bpe_train_mb << 20, 0
    stats = UnitStats()
    for unit in plan.units:
        for piece in _unit_texts(unit, stats, cfg):
            yield piece
            seen += len(piece)
            if seen >= limit:
                return


def _unit_texts(unit: Unit, stats: UnitStats, cfg: PrepareConfig):
    """A unit's texts as the bpe trains on them: documents' pieces, or conversations'
    contents."""
    if not cfg.chat:
        yield from (piece for _, piece in table.pieces(unit, stats, cfg.text_field,
                                                       cfg.skip_bad_rows, False))
        return
    records = table.records(unit, stats, cfg.record_field, cfg.skip_bad_rows)
    for conv in chat.conversations(records, stats, chat.Reading(cfg.strict), UserError):
        yield from (m["content"] for m in conv)


def verify(path: str) -> None:
    ds = TokenDataset(path)  # then every shard re-hashed, whatever verified.json says
    print(f"{path}: ok ({check_all(ds)} shards, {ds.num_tokens('train'):,} train + "
          f"{ds.num_tokens('val'):,} val tokens, {ds.tokenizer} vocab {ds.vocab_size})")

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

Each text file, jsonl line or parquet row is one document, in a fixed order (sources in the order
given, files sorted, rows in file order; meta.json lists the files). Text files: invalid UTF-8
is replaced (counted) for bpe and gpt2, kept exactly by the byte tokenizer; files with NUL bytes
are skipped as binary, empty ones as empty. Every document is preceded by the end-of-text token,
so the stream reads EOT doc EOT doc ... and a model sampled from EOT starts a fresh document.

The corpus is cut into units (formats.py) that `--workers` processes encode (units.py); the
assembler appends them in order (assemble.py), so the shards are the same for any number of
workers, parts or interruptions. Output goes to `.NAME.partial` beside `--out`, renamed to
`--out` only when complete; an interrupted prepare continues there (build.py). A document longer
than `sources.PIECE_CHARS` is read and encoded in pieces, cut before a word where it can be
(`sources._cut_point`), so that memory stays bounded per document too. The bpe tokenizer is
trained first, on at most `bpe_train_mb` of the corpus.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import sys
import time
from contextlib import ExitStack, suppress
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace

from ddpgpt import __version__
from ddpgpt.config.commands import PrepareConfig
from ddpgpt.data import formats, space
from ddpgpt.data import settings as settings_of
from ddpgpt.data.assemble import Assembler, SplitWriter, is_val  # noqa: F401 (re-exported)
from ddpgpt.data.build import Build, check_settings, part_range
from ddpgpt.data.output import CleanExit, Lock, check_out, make_partial, partial_of, publish
from ddpgpt.data.shards import META_FORMAT_VERSION, ShardInfo, TokenDataset, dtype_for_vocab
from ddpgpt.data.sources import resolve_sources
from ddpgpt.data.tokenizer import BPETokenizer, TokenizerSpec, fingerprint, load_tokenizer
from ddpgpt.data.verify import check_all, record_shards
from ddpgpt.errors import UserError

ORDER = "sources in the order given, files sorted by path, rows in file order"
PART_FILE = "part.json"


def run(cfg: PrepareConfig) -> None:
    if cfg.verify is not None:
        return verify(Path(cfg.verify))
    if cfg.out is None:
        raise UserError("ddpgpt prepare needs --out DIR (or --verify DIR)")
    out = Path(cfg.out)
    check_out(out, cfg.force)
    tmp = partial_of(out)
    cfg, job = _merge_job(cfg) if cfg.merge else (cfg, _source_job(cfg, out, tmp))
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
            finished = True
            check_out(out, cfg.force)
            signals.hold()  # from here the dataset is published whatever comes: a signal
            stack.close()  # (the lock goes with the partial's name)
            publish(tmp, out)  # between its two renames would lose the old --out
        finally:
            if locked and (finished or job.get("read") or _nothing_done(job)):
                shutil.rmtree(tmp, ignore_errors=True)  # nothing to continue
            if not tmp.exists():
                for path in reversed(made):  # parents made for a run that leaves nothing
                    with suppress(OSError):  # behind; rmdir removes only empty directories
                        path.rmdir()
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file()) / 1e6
    print(summary(out, time.perf_counter() - start, size))


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
    plan = formats.plan(corpus, cfg.text_field)
    settings_of.check_sources(cfg, plan.llmc)
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
        "sources": corpus.specs, "plan": formats.plan_record(plan),
        "stamps": plan.stamps, "tokenizer": tok["identity"],
        "val_fraction": cfg.val_fraction, "shard_tokens": cfg.shard_tokens,
        "text_field": cfg.text_field, "skip_bad_rows": cfg.skip_bad_rows,
        "max_tokens": cfg.max_tokens, "part": cfg.part, "bpe_train_mb": cfg.bpe_train_mb,
    }
    return {"plan": plan, "tok": tok, "settings": settings, "specs": corpus.specs}


def _tokenizer_choice(cfg: PrepareConfig, plan: formats.Plan) -> dict:
    """kind, where its tokenizer.json comes from (bpe), and what identifies it."""
    if plan.llmc:
        return {"kind": "gpt2", "dir": None, "identity": "gpt2 (llm.c shards)"}
    if cfg.tokenizer_from is not None:
        kind, directory = tokenizer_from(Path(cfg.tokenizer_from))
        return {"kind": kind, "dir": directory, "identity": fingerprint(kind, directory)}
    identity = cfg.tokenizer if cfg.tokenizer != "bpe" else f"bpe trained, vocab {cfg.vocab_size}"
    return {"kind": cfg.tokenizer, "dir": None, "identity": identity}


def tokenizer_from(path: Path) -> tuple[str, Path]:
    """The tokenizer kind of a prepared dataset (meta.json) or a run (data_meta.json), and the
    directory that holds its tokenizer.json."""
    for name in ("meta.json", "data_meta.json"):
        meta = path / name
        if meta.is_file():
            try:
                kind = json.loads(meta.read_text())["tokenizer"]
            except (ValueError, KeyError, TypeError):
                raise UserError(f"--tokenizer-from {path}: {meta} names no tokenizer; give a "
                                "prepared dataset or a run directory") from None
            if kind == "bpe" and not (path / "tokenizer.json").is_file():
                raise UserError(f"--tokenizer-from {path}: no tokenizer.json beside {meta}; "
                                "give a prepared dataset or a run directory")
            return kind, path
    raise UserError(f"--tokenizer-from {path}: neither a prepared dataset (meta.json) nor a run "
                    "directory (data_meta.json); give one of them")


def _merge_job(cfg: PrepareConfig) -> tuple[PrepareConfig, dict]:
    """Part directories -> the plan they share, checked to be all N parts of one prepare; the
    merge's settings with the parts' split and shard size applied (data/settings.py)."""
    settings_of.check_merge(cfg)
    dirs = sorted({Path(m) for spec in cfg.sources
                   for m in (sorted(glob.glob(spec)) if glob.has_magic(spec) else [spec])})
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
    units = [formats.Unit(**{**u, "paths": tuple(u["paths"])}) for u in first["plan_units"]]
    plan = formats.Plan(units, first["files"], first["text_bytes"])
    tok = {"kind": first["tokenizer"], "dir": dirs[0], "identity": first["identity"]}
    owners = {i: d / "units" for d, p in parts.items()
              for i in part_range(len(plan.units), tuple(p["part"]))}
    settings = {"merge": [str(d.resolve()) for d in dirs], "val_fraction": cfg.val_fraction,
                "shard_tokens": cfg.shard_tokens, "max_tokens": cfg.max_tokens}
    return cfg, {"plan": plan, "tok": tok, "settings": settings, "specs": first["specs"],
                 "owners": owners, "text_field": first["settings"]["text_field"]}


# --- the build -----------------------------------------------------------------------------


def _build(cfg: PrepareConfig, job: dict, tmp: Path, out: Path):
    """Everything between the partial's creation and its publication; returns the summary."""
    plan = job["plan"]
    resumed = check_settings(tmp, job["settings"], out)
    tok = _tokenizer(cfg, job, tmp)
    dtype = dtype_for_vocab(tok.vocab_size)
    part = cfg.part_of
    asm = None if part else Assembler(tmp, dtype, cfg.shard_tokens, cfg.val_fraction,
                                      cfg.max_tokens)
    workers = cfg.workers or len(os.sched_getaffinity(0))
    spec = TokenizerSpec(tok.kind, str(tmp) if tok.kind == "bpe" else None)
    owned = part_range(len(plan.units), part) if part else None
    build = Build(tmp, plan, asm, workers, (spec, dtype, tmp / "units", cfg.text_field,
                                            cfg.skip_bad_rows), owned)
    build.sources, build.local_tok = job.get("owners", {}), tok
    job["build"] = build
    if resumed and build.done:
        print(f"continuing the prepare in {tmp}: {build.done} of {len(build.owned)} units done"
              + (f", {asm.tokens:,} tokens in the shards" if asm else ""), flush=True)
    build.run()
    if part:
        return _finish_part(cfg, job, tok, tmp, build)
    return _finish_dataset(cfg, job, tok, dtype, tmp, build)


def _tokenizer(cfg: PrepareConfig, job: dict, tmp: Path):
    """The tokenizer, with its tokenizer.json in the partial for bpe (trained once: a resumed
    prepare loads the one it trained)."""
    info = job["tok"]
    if job["plan"].llmc:
        return SimpleNamespace(kind="gpt2", vocab_size=formats.LLMC_VOCAB,
                               eot_id=formats.LLMC_EOT, save=lambda d: None)
    if info["dir"] is not None and info["kind"] == "bpe":
        if not (tmp / "tokenizer.json").is_file():
            shutil.copyfile(Path(info["dir"]) / "tokenizer.json", tmp / "tokenizer.json")
        return load_tokenizer(tmp, "bpe")
    if info["kind"] != "bpe":
        return TokenizerSpec(info["kind"])()
    if (tmp / "tokenizer.json").is_file():
        return load_tokenizer(tmp, "bpe")
    tok = BPETokenizer.train(_training_texts(job["plan"], cfg), cfg.vocab_size,
                             show_progress=sys.stderr.isatty())
    tok.save(tmp)  # atomically: a tokenizer.json in the partial is whole
    return tok


def _training_texts(plan: formats.Plan, cfg: PrepareConfig):
    """The first `bpe_train_mb` of the corpus's text, in order: what the bpe is trained on."""
    limit, seen = cfg.bpe_train_mb << 20, 0
    stats = formats.UnitStats()
    for unit in plan.units:
        for _, piece in formats.pieces(unit, stats, cfg.text_field, cfg.skip_bad_rows, False):
            yield piece
            seen += len(piece)
            if seen >= limit:
                return


def _finish_dataset(cfg: PrepareConfig, job: dict, tok, dtype: str, tmp: Path, build: Build):
    asm = build.asm
    llmc = job["plan"].llmc
    job["read"] = True  # all of the corpus: an error from here leaves nothing to continue
    _check_documents(cfg, job, asm)
    if not llmc and asm.documents["train"] == 0:
        build.restart_assembly()  # the split by position rewrites the shards
    shards, note = asm.finish(None if llmc else tok.decode_bytes)
    record_shards(tmp, shards)  # hashed as written: a training start need not hash them again
    for split in ("train", "val"):
        if not shards[split] or not sum(i.tokens for i in shards[split]):
            raise UserError(_empty_split(split, llmc, job))
    split_how = "llm.c files" if llmc else "tokens" if note else "documents"
    source = {"specs": job["specs"], "order": ORDER, "files": job["plan"].files,
              "val_fraction": cfg.val_fraction, "split": split_how,
              "text_field": job.get("text_field", cfg.text_field), "max_tokens": cfg.max_tokens,
              "stats": _stats(asm)}
    meta = make_meta(tok, dtype, shards, source, None if llmc else asm.bytes)
    if not llmc:
        tok.save(tmp)
    build.clean()
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")  # last: marks complete
    return _summary(meta, asm, tok, note)


def _stats(asm: Assembler) -> dict:
    stats = asdict(asm.stats)
    stats.update(train_documents=asm.documents["train"], val_documents=asm.documents["val"])
    stats["documents"] = stats["train_documents"] + stats["val_documents"]
    return stats


def _check_documents(cfg: PrepareConfig, job: dict, asm: Assembler) -> None:
    if job["plan"].llmc or sum(asm.documents.values()):
        return
    s = asm.stats
    bad = f", {s.bad_rows} bad rows" if s.bad_rows else ""
    raise UserError(f"no documents in {' '.join(job['specs'])} ({s.skipped_binary} binary "
                    f"and {s.skipped_empty} empty files skipped{bad}); give a source with text")


def _empty_split(split: str, llmc: bool, job: dict) -> str:
    if llmc:
        has = "is named as a val shard" if split == "val" else "is named as a train shard"
        return (f"the {split} split is empty: no llm.c shard of {' '.join(job['specs'])} {has} "
                "(val: the word val in its name, as llm.c's *_val_*.bin); give train and val "
                "shards")
    return (f"the {split} split is empty (--max-tokens or --val-fraction too small for this "
            "corpus); give more data or change them")


def _finish_part(cfg: PrepareConfig, job: dict, tok, tmp: Path, build: Build):
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


def make_meta(tok, dtype: str, shards: dict[str, list[ShardInfo]], source: dict,
              split_bytes: dict[str, int] | None = None) -> dict:
    """The contents of a dataset's meta.json (read back by `shards.TokenDataset`). `bytes`: each
    split's UTF-8 bytes of text, which with its token count turns a loss per token into bits
    per byte (datasets prepared before it, and from llm.c shards, lack it)."""
    meta = {
        "format_version": META_FORMAT_VERSION,
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
    return meta


def verify(path: Path) -> None:
    ds = TokenDataset(path)  # then every shard re-hashed, whatever verified.json says
    print(f"{path}: ok ({check_all(ds)} shards, {ds.num_tokens('train'):,} train + {ds.num_tokens('val'):,} "
          f"val tokens, {ds.tokenizer} vocab {ds.vocab_size})")


def _summary(meta: dict, asm: Assembler, tok, note: str | None):
    """The summary, as a function of --out, the seconds taken and the output's MB."""
    tokens = {s: sum(i["tokens"] for i in meta["shards"][s]) for s in ("train", "val")}
    total = tokens["train"] + tokens["val"]
    s, docs = asm.stats, asm.documents
    n_docs = docs['train'] + docs['val']
    what = (f"{n_docs:,} document{'s' if n_docs != 1 else ''} ({docs['train']:,} train, "
            f"{docs['val']:,} val)" if meta["source"]["split"] != "llm.c files"
            else f"{asm.units} llm.c shards")
    extra = []
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

    def text(out: Path, seconds: float, size: float) -> str:
        return "\n".join([
            f"prepared {out}: {what}, {total:,} tokens ({tokens['train']:,} train, "
            f"{tokens['val']:,} val), {meta['tokenizer']} vocab {meta['vocab_size']}",
            f"skipped {s.skipped_binary} binary and {s.skipped_empty} empty files; "
            f"{s.text_bytes / 1e6:.1f} MB of text in {seconds:.1f} s "
            f"({total / max(seconds, 1e-9) / 1e6:.2f}M tokens/s); output {size:.1f} MB",
            *extra])
    return text

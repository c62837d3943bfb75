"""`ddpgpt prepare` on parquet, jsonl (plain, .gz, .zst), llm.c shards and single-file corpora:
each prepares to exactly its documents, in the recorded order; bad input is one line."""

import gzip
import json
import math
import resource
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ddpgpt.config.commands import PrepareConfig
from ddpgpt.data.formats import base, jsonl, llmc
from ddpgpt.data.loader import TokenStream
from ddpgpt.data.prepare import main as prepare
from ddpgpt.data.prepare.assemble import is_val
from ddpgpt.data.shards import TokenDataset
from ddpgpt.data.tokenizer import load_tokenizer
from ddpgpt.errors import UserError
from tests.helpers import TIKTOKEN_GPT2, json_error
from tests.processes import run_cli

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
zstandard = pytest.importorskip("zstandard")



def docs_named(prefix, n):
    return [f"{prefix} document {i}: caf\u00e9 \u2713 " + "words " * (i % 7) for i in range(n)]


def write_parquet(path, texts, row_group_size, column="text", extra=True):
    table = {column: texts}
    if extra:
        table["id"] = list(range(len(texts)))
    pq.write_table(pa.table(table), path, row_group_size=row_group_size)


def jsonl_bytes(texts, field="text"):
    return b"".join(json.dumps({"id": i, field: t}).encode() + b"\n" for i, t in enumerate(texts))


def run(sources, out, **kw):
    kw.setdefault("workers", 1)
    prepare.run(PrepareConfig(sources=[str(s) for s in sources], out=str(out), **kw))
    return TokenDataset(out)


def byte_oracle(docs, fraction):
    """The documented stream: EOT then the document's UTF-8 bytes, whole documents to a split."""
    out = {"train": [], "val": []}
    for i, doc in enumerate(docs):
        data = doc if isinstance(doc, bytes) else doc.encode()
        out["val" if is_val(i, round(fraction * 1e6)) else "train"] += [256, *data]
    return out


def assert_stream(ds, expected):
    for split in ("train", "val"):
        np.testing.assert_array_equal(np.concatenate(ds.tokens(split)), expected[split])


@pytest.fixture
def mixed(tmp_path):
    """A directory of every format, whose documents in prepare's order are `docs`."""
    src = tmp_path / "src"
    src.mkdir()
    parts = {
        "a.parquet": docs_named("parquet", 23),
        "b.jsonl": docs_named("jsonl", 9),
        "c.jsonl.gz": docs_named("gz", 5),
        "d.jsonl.zst": docs_named("zst", 4),
        "e.json.gz": docs_named("jsongz", 3),
        "f.txt": ["a plain text file\n"],
    }
    write_parquet(src / "a.parquet", parts["a.parquet"], row_group_size=5)
    (src / "b.jsonl").write_bytes(jsonl_bytes(parts["b.jsonl"]) + b"\n")  # a blank line: skipped
    (src / "c.jsonl.gz").write_bytes(gzip.compress(jsonl_bytes(parts["c.jsonl.gz"])))
    (src / "d.jsonl.zst").write_bytes(
        zstandard.ZstdCompressor().compress(jsonl_bytes(parts["d.jsonl.zst"])))
    (src / "e.json.gz").write_bytes(gzip.compress(jsonl_bytes(parts["e.json.gz"])))
    (src / "f.txt").write_text(parts["f.txt"][0])
    return src, [d for name in sorted(parts) for d in parts[name]]


def test_every_format_prepares_to_exactly_its_documents_in_the_recorded_order(mixed, tmp_path,
                                                                              capsys):
    src, docs = mixed
    ds = run([src], tmp_path / "out", tokenizer="byte", val_fraction=0.2)
    assert_stream(ds, byte_oracle(docs, 0.2))
    source = ds.meta["source"]
    assert source["order"] == "sources in the order given, files sorted by path, rows in file order"
    assert [Path(f["path"]).name for f in source["files"]] == sorted(p.name for p in src.iterdir())
    assert source["files"][0]["row_groups"] == 5  # 23 rows, 5 per group
    assert source["stats"]["documents"] == len(docs) == 45
    assert f"{len(docs)} documents" in capsys.readouterr().out


def test_plain_jsonl_in_blocks_is_the_same_stream(tmp_path, monkeypatch, capsys):
    """A .jsonl is cut into blocks of units (each line read by the block it starts in): any block
    size gives every line once."""
    docs = docs_named("line", 40)
    (tmp_path / "a.jsonl").write_bytes(jsonl_bytes(docs))
    for unit_bytes in (97, 1000, 1 << 20):
        monkeypatch.setattr(base, "UNIT_BYTES", unit_bytes)
        ds = run([tmp_path / "a.jsonl"], tmp_path / f"out{unit_bytes}", tokenizer="byte",
                 val_fraction=0.1)
        assert_stream(ds, byte_oracle(docs, 0.1))


def test_text_field_picks_the_column_and_field(tmp_path, capsys):
    docs = docs_named("content", 6)
    write_parquet(tmp_path / "a.parquet", docs, row_group_size=4, column="content")
    (tmp_path / "b.jsonl").write_bytes(jsonl_bytes(docs, field="content"))
    ds = run([tmp_path / "a.parquet", tmp_path / "b.jsonl"], tmp_path / "out", tokenizer="byte",
             val_fraction=0.25, text_field="content")
    assert_stream(ds, byte_oracle(docs + docs, 0.25))


def refused(sources, tmp_path, *flags):
    """The command's one line of error; nothing published, no partial left."""
    result = run_cli("prepare", *sources, "--out", tmp_path / "o", "--tokenizer", "byte",
                     "--workers", "1", *flags)
    assert result.returncode == 2, result.stdout
    assert [p.name for p in tmp_path.iterdir() if p.name in ("o", ".o.partial")] == []
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("ddpgpt: error: ")
    return result.stderr[len("ddpgpt: error: "):-1]


def test_missing_text_field_names_the_fields(tmp_path):
    write_parquet(tmp_path / "a.parquet", ["x"], row_group_size=1, column="body")
    assert refused([tmp_path / "a.parquet"], tmp_path) == (
        f"{tmp_path}/a.parquet: no column 'text' (columns: body, id); name the text column "
        "with --text-field")
    (tmp_path / "b.jsonl").write_bytes(jsonl_bytes(["x"]) + b'{"id": 7, "body": "y"}\n')
    assert refused([tmp_path / "b.jsonl"], tmp_path) == (
        f"{tmp_path}/b.jsonl:2: no field 'text' (fields: id, body); name the text field with "
        f"--text-field, {jsonl.SKIP_HINT}")


def test_a_malformed_line_names_file_and_line_or_is_counted_and_skipped(tmp_path, monkeypatch,
                                                                        capsys):
    """The bad line sits in the third block of the file: its number counts the lines before."""
    monkeypatch.setattr(base, "UNIT_BYTES", 200)
    docs = docs_named("line", 12)
    lines = jsonl_bytes(docs).splitlines(keepends=True)
    bad = b'{"text": "unterminated\n'
    data = b"".join(lines[:8]) + bad + b"[1, 2]\n" + b"".join(lines[8:])
    (tmp_path / "a.jsonl").write_bytes(data)
    assert data.index(bad) >= 400  # beyond the first two blocks
    with pytest.raises(UserError) as e:
        run([tmp_path / "a.jsonl"], tmp_path / "o", tokenizer="byte")
    assert str(e.value) == (f"{tmp_path}/a.jsonl:9: not a JSON object "
                            f"({json_error(bad.decode())}); fix the line, {jsonl.SKIP_HINT}")
    assert not (tmp_path / "o").exists()
    ds = run([tmp_path / "a.jsonl"], tmp_path / "o2", tokenizer="byte", val_fraction=0.25,
             skip_bad_rows=True)
    assert_stream(ds, byte_oracle(docs, 0.25))
    assert "skipped 2 bad rows (--skip-bad-rows)" in capsys.readouterr().out
    assert ds.meta["source"]["stats"]["bad_rows"] == 2


def test_a_corrupt_parquet_names_the_file(tmp_path):
    write_parquet(tmp_path / "a.parquet", ["x"], row_group_size=1)
    data = (tmp_path / "a.parquet").read_bytes()
    (tmp_path / "a.parquet").write_bytes(data[:len(data) // 2])
    message = refused([tmp_path / "a.parquet"], tmp_path)
    assert message.startswith(f"{tmp_path}/a.parquet: not a readable parquet file (")
    assert message.endswith("); download it again or remove it from the sources")


# --- llm.c shards ------------------------------------------------------------------------------


def write_llmc(path, tokens, magic=llmc.MAGIC, version=1, count=None, cut=0):
    header = np.zeros(256, dtype="<i4")
    header[:3] = magic, version, len(tokens) if count is None else count
    data = header.tobytes() + np.asarray(tokens, dtype="<u2").tobytes()
    path.write_bytes(data[:len(data) - cut])


def test_llmc_shards_are_taken_as_their_tokens(tmp_path, capsys):
    """No decoding, no EOT of ours: train is the train files' tokens in name order, val the
    val file's; the dataset's tokenizer is gpt2."""
    rng = np.random.default_rng(0)
    shards = {name: rng.integers(0, 50257, size=n) for name, n in
              [("edu_train_000002.bin", 300), ("edu_train_000001.bin", 500),
               ("edu_val_000000.bin", 200)]}
    (tmp_path / "s").mkdir()
    for name, tokens in shards.items():
        write_llmc(tmp_path / "s" / name, tokens)
    ds = run([tmp_path / "s"], tmp_path / "out", shard_tokens=256)
    train = np.concatenate([shards["edu_train_000001.bin"], shards["edu_train_000002.bin"]])
    np.testing.assert_array_equal(np.concatenate(ds.tokens("train")), train)
    np.testing.assert_array_equal(np.concatenate(ds.tokens("val")), shards["edu_val_000000.bin"])
    assert (ds.tokenizer, ds.vocab_size, ds.eot_id) == ("gpt2", 50257, 50256)
    assert ds.meta["source"]["split"] == "llm.c files"
    # No text, so no bytes: nothing a new prepare could add, and the loss is not concerned.
    assert ds.split_bytes is None and ds.bits_per_byte(2.0) is None
    assert ds.bytes_advice() == (
        f"dataset {ds.path} was prepared from tokens (llm.c files) whose text ddpgpt never saw: "
        "bits per byte need the text's size in bytes, so val_bpb is not reported (val_loss is "
        "unaffected)")
    assert "3 llm.c shards, 1,000 tokens (800 train, 200 val), gpt2" in capsys.readouterr().out
    # The training windows are slices of exactly those tokens (shard boundaries included).
    stream = TokenStream(ds, "train", 99)
    rows = np.zeros((stream.num_windows, 100), dtype=np.int64)
    stream.read(np.arange(stream.num_windows), rows)
    for w, row in enumerate(rows):
        np.testing.assert_array_equal(row, train[w * 99:w * 99 + 100])


def test_bad_llmc_shards_are_one_line_each(tmp_path):
    write_llmc(tmp_path / "x_val_000000.bin", [1, 2, 3])
    good = str(tmp_path / "x_val_000000.bin")
    write_llmc(tmp_path / "x_train_1.bin", [1, 2, 3], magic=12345)
    assert refused([good, tmp_path / "x_train_1.bin"], tmp_path) == (
        f"{tmp_path}/x_train_1.bin: not an llm.c shard (magic 12345, expected 20240520) among the "
        f"llm.c shards of the sources ({good}); remove it from them")
    write_llmc(tmp_path / "x_train_2.bin", [1, 2, 3], version=2)
    assert refused([good, tmp_path / "x_train_2.bin"], tmp_path) == (
        f"{tmp_path}/x_train_2.bin: llm.c shard version 2, expected 1 (uint16 GPT-2 tokens); "
        "convert it or remove it from the sources")
    write_llmc(tmp_path / "x_train_3.bin", [1, 2, 3, 4], cut=2)
    assert refused([good, tmp_path / "x_train_3.bin"], tmp_path) == (
        f"{tmp_path}/x_train_3.bin: llm.c shard truncated: its header says 4 tokens (1032 bytes) "
        "but the file has 1030 bytes; download it again")
    (tmp_path / "notes.txt").write_text("text")
    assert refused([good, tmp_path / "notes.txt"], tmp_path) == (
        f"the sources mix llm.c shards ({good}) with text ({tmp_path}/notes.txt); the shards are "
        "tokens already: prepare them apart from the text")
    assert refused([good], tmp_path, "--tokenizer", "gpt2").startswith(
        "the train split is empty: no llm.c shard of ")


# --- one file, tokenizers ----------------------------------------------------------------------


def test_one_big_file_is_split_by_token_position(tmp_path, capsys):
    """nanoGPT's input.txt: one document; the last val_fraction of its tokens are val."""
    data = ("First Citizen:\nBefore we proceed any further, hear me speak.\n\n" * 200).encode()
    (tmp_path / "input.txt").write_bytes(data)
    ds = run([tmp_path / "input.txt"], tmp_path / "out", tokenizer="byte", val_fraction=0.1)
    stream = [256, *data]
    n_val = math.ceil(len(stream) * 0.1)
    assert_stream(ds, {"train": stream[:-n_val], "val": stream[-n_val:]})
    assert ds.split_bytes == {"train": len(data) - n_val, "val": n_val}
    assert ds.meta["source"]["split"] == "tokens"
    assert (f"split by token position: 1 document: too few to split by document, so the last "
            f"0.1 of the tokens ({n_val:,}) are the validation split") in capsys.readouterr().out


def test_bpe_counts_replacements_and_byte_keeps_the_bytes(tmp_path, capsys):
    data = b"good text \xff\xfe bad \xc3 bytes \xef\xbf\xbd (a real U+FFFD) end\n" * 20
    (tmp_path / "a.txt").write_bytes(data)
    (tmp_path / "b.txt").write_bytes(b"second document\n" * 20)
    ds = run([tmp_path], tmp_path / "bpe", vocab_size=300, val_fraction=0.5)
    replaced = data.decode("utf-8", "replace").count("\ufffd") - data.count(b"\xef\xbf\xbd")
    assert replaced == 60
    assert f"replaced {replaced:,} invalid UTF-8 sequences by U+FFFD" in capsys.readouterr().out
    assert ds.meta["source"]["stats"]["replaced"] == replaced
    ds = run([tmp_path / "a.txt", tmp_path / "b.txt"], tmp_path / "byte", tokenizer="byte",
             val_fraction=0.5)
    assert "replaced" not in capsys.readouterr().out
    assert_stream(ds, byte_oracle([data, b"second document\n" * 20], 0.5))


def test_tokenizer_from_a_dataset_or_a_run_reuses_its_tokenizer(tmp_path, capsys):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "one.txt").write_text("the first corpus, its own words\n" * 50)
    (tmp_path / "a" / "two.txt").write_text("more of the first corpus\n" * 50)
    first = run([tmp_path / "a"], tmp_path / "first", vocab_size=300, val_fraction=0.5)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "data_meta.json").write_bytes((first.path / "meta.json").read_bytes())
    (run_dir / "tokenizer.json").write_bytes((first.path / "tokenizer.json").read_bytes())
    new_docs = ["new words for the old model\n" * 30, "and a second new document\n" * 30]
    (tmp_path / "b").mkdir()
    for i, doc in enumerate(new_docs):
        (tmp_path / "b" / f"{i}.txt").write_text(doc)
    tok = load_tokenizer(first.path, "bpe")
    for origin in (first.path, run_dir):
        ds = run([tmp_path / "b"], tmp_path / f"new_{origin.name}", tokenizer_from=str(origin),
                 val_fraction=0.5)
        assert (ds.path / "tokenizer.json").read_bytes() == \
            (first.path / "tokenizer.json").read_bytes()
        assert ds.tokenizer_fingerprint == first.tokenizer_fingerprint
        expected = [[ds.eot_id, *ids] for ids in tok.encode_batch(new_docs)]
        assert_stream(ds, {"val": expected[0], "train": expected[1]})
    with pytest.raises(UserError) as e:
        run([tmp_path / "b"], tmp_path / "x", tokenizer_from=str(tmp_path / "b"))
    assert str(e.value) == (f"--tokenizer-from {tmp_path}/b: neither a prepared dataset "
                            "(meta.json), a run directory (data_meta.json) nor a transformers "
                            "directory (config.json); give one of them")


def test_a_copy_of_tokenizer_from_cut_short_is_never_taken_for_the_tokenizer(tmp_path):
    """A prepare whose copy of --tokenizer-from's tokenizer.json fails midway (here: the file
    size limit, EFBIG, at half its size) in a partial left by an earlier run (a kill after the
    partial was made) leaves no tokenizer.json there: the same command then continues with the
    whole one, never a torn one."""
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "one.txt").write_text("the first corpus, its own words\n" * 50)
    first = run([tmp_path / "a"], tmp_path / "first", vocab_size=300, val_fraction=0.5)
    whole = (first.path / "tokenizer.json").read_bytes()
    (tmp_path / "b.txt").write_text("new words for the old model\n" * 30)
    out, partial = tmp_path / "out", tmp_path / ".out.partial"
    partial.mkdir()  # an earlier run's: kept whatever happens now
    limit = len(whole) // 2

    def small_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    cut = subprocess.run([sys.executable, "-m", "ddpgpt", "prepare", tmp_path / "b.txt",
                          "--out", out, "--tokenizer-from", first.path, "--workers", "1"],
                         preexec_fn=small_files, capture_output=True, text=True, timeout=120)
    assert cut.returncode != 0 and "File too large" in cut.stderr, cut.stderr
    assert (partial / "settings.json").is_file()  # the earlier partial, kept
    assert sorted(p.name for p in partial.iterdir()) == ["lock", "settings.json"]
    ds = run([tmp_path / "b.txt"], out, tokenizer_from=str(first.path))
    assert (ds.path / "tokenizer.json").read_bytes() == whole


@pytest.mark.skipif(not TIKTOKEN_GPT2.is_dir(), reason="GPT-2's files are not in ../shared")
def test_gpt2_on_parquet_is_tiktokens_encoding(tmp_path, capsys):
    import tiktoken  # TIKTOKEN_CACHE_DIR: tests/conftest.py

    docs = docs_named("gpt2", 12)
    write_parquet(tmp_path / "a.parquet", docs, row_group_size=5)
    ds = run([tmp_path / "a.parquet"], tmp_path / "out", tokenizer="gpt2", val_fraction=0.25)
    enc = tiktoken.get_encoding("gpt2")
    expected = {"train": [], "val": []}
    for i, doc in enumerate(docs):
        split = "val" if is_val(i, 250_000) else "train"
        expected[split] += [50256, *enc.encode_ordinary(doc)]
    assert_stream(ds, expected)
    assert ds.split_bytes["val"] == sum(len(d.encode()) for i, d in enumerate(docs)
                                        if is_val(i, 250_000))


"""Inputs that `prepare` used to lose data on without a word, or answered with a traceback: a
truncated or multi-frame `.zst`, a file named twice, llm.c shards' names and ids, settings a job
ignored, parquet text columns that are not text, null rows, and a full disk (from a worker and
from the assembler). Each is the right dataset or one line."""

import json
import subprocess
import sys

import numpy as np
import pytest

from ddpgpt.config.commands import PrepareConfig
from ddpgpt.data.formats import llmc
from ddpgpt.data.prepare import main as prepare
from tests.processes import run_cli
from tests.unit.test_prepare_formats import (
    assert_stream,
    byte_oracle,
    docs_named,
    jsonl_bytes,
    refused,
    run,
    write_llmc,
    write_parquet,
)

pa = pytest.importorskip("pyarrow")
zstandard = pytest.importorskip("zstandard")


# --- compressed jsonl ----------------------------------------------------------------------------


def test_a_truncated_zst_is_one_line_with_or_without_skip_bad_rows(tmp_path):
    """Cut in the middle, a .zst read as a shorter file whose last line was a bad row: 149 of
    300 rows were kept with --skip-bad-rows. It is an error naming the file, as a cut .gz is."""
    data = zstandard.ZstdCompressor().compress(jsonl_bytes(docs_named("z", 300)))
    (tmp_path / "a.jsonl.zst").write_bytes(data[:len(data) // 2])
    expected = (f"{tmp_path}/a.jsonl.zst: cannot be read (EOFError: Compressed file ended "
                "before the end-of-stream marker was reached); download it again or remove it "
                "from the sources")
    assert refused([tmp_path / "a.jsonl.zst"], tmp_path) == expected
    assert refused([tmp_path / "a.jsonl.zst"], tmp_path, "--skip-bad-rows") == expected


def test_every_frame_of_a_zst_is_read(tmp_path):
    """`cat a.zst b.zst` (and pzstd's output) is one file of two frames: all of its rows."""
    first, second = docs_named("one", 5), docs_named("two", 7)
    z = zstandard.ZstdCompressor()
    (tmp_path / "a.jsonl.zst").write_bytes(z.compress(jsonl_bytes(first))
                                           + z.compress(jsonl_bytes(second)))
    ds = run([tmp_path / "a.jsonl.zst"], tmp_path / "o", tokenizer="byte", val_fraction=0.25)
    assert_stream(ds, byte_oracle(first + second, 0.25))


def test_compressed_text_is_text(tmp_path, capsys):
    """notes.txt.gz and notes.md.zst are their text, one document each, not skipped as binary
    (their bytes hold NULs); a .gz cut short is one line naming it."""
    import gzip

    docs = ["first notes\n" * 50, "ünïcode notes\n" * 300_000, "third\n"]  # one past a piece
    (tmp_path / "a.txt").write_text(docs[0])
    (tmp_path / "b.txt.gz").write_bytes(gzip.compress(docs[1].encode()))
    (tmp_path / "c.md.zst").write_bytes(zstandard.ZstdCompressor().compress(docs[2].encode()))
    sources = [tmp_path / n for n in ("a.txt", "b.txt.gz", "c.md.zst")]
    ds = run(sources, tmp_path / "o", tokenizer="byte", val_fraction=0.25)
    assert "skipped 0 binary and 0 empty files" in capsys.readouterr().out
    assert_stream(ds, byte_oracle(docs, 0.25))
    cut = tmp_path / "cut"
    cut.mkdir()
    (cut / "b.txt.gz").write_bytes(gzip.compress(docs[1].encode())[:5000])
    assert refused([cut / "b.txt.gz"], cut).startswith(
        f"{cut}/b.txt.gz: cannot be read (EOFError: Compressed file ended before the "
        "end-of-stream marker was reached); download it again")


# --- sources named twice -------------------------------------------------------------------------


def test_a_file_named_twice_is_prepared_once(tmp_path, capsys):
    """`prepare pq/a.parquet pq/`: a.parquet once, where it is first named, and a note says so;
    never its documents twice (where copies could land in train and val)."""
    (tmp_path / "pq").mkdir()
    a, b = docs_named("a", 6), docs_named("b", 4)
    write_parquet(tmp_path / "pq" / "a.parquet", a, row_group_size=4)
    write_parquet(tmp_path / "pq" / "b.parquet", b, row_group_size=4)
    (tmp_path / "link.parquet").symlink_to(tmp_path / "pq" / "a.parquet")
    ds = run([tmp_path / "pq" / "a.parquet", tmp_path / "pq", tmp_path / "link.parquet"],
             tmp_path / "o", tokenizer="byte", val_fraction=0.25)
    assert_stream(ds, byte_oracle(a + b, 0.25))
    assert ds.meta["source"]["stats"]["documents"] == 10
    assert [f["path"] for f in ds.meta["source"]["files"]] == \
        [str(tmp_path / "pq" / "a.parquet"), str(tmp_path / "pq" / "b.parquet")]
    assert (f"ddpgpt: note: 2 files are named by more than one source "
            f"({tmp_path / 'pq' / 'a.parquet'}, ...): each file is prepared once, where it is "
            "first named") in capsys.readouterr().err


# --- llm.c shards --------------------------------------------------------------------------------


def test_llmc_val_shards_are_named_by_the_word_val(tmp_path):
    """`interval_train_000001.bin` is a train shard: val is a word of the name, not letters."""
    rng = np.random.default_rng(1)
    shards = {name: rng.integers(0, 50257, size=n) for name, n in
              [("interval_train_000001.bin", 300), ("val_000000.bin", 100),
               ("TinyStories-val.bin", 50)]}
    (tmp_path / "s").mkdir()
    for name, tokens in shards.items():
        write_llmc(tmp_path / "s" / name, tokens)
    ds = run([tmp_path / "s"], tmp_path / "o")
    np.testing.assert_array_equal(np.concatenate(ds.tokens("train")),
                                  shards["interval_train_000001.bin"])
    np.testing.assert_array_equal(np.concatenate(ds.tokens("val")), np.concatenate(
        [shards["TinyStories-val.bin"], shards["val_000000.bin"]]))
    assert llmc.split_of("fineweb_val_000000.bin") == "val"
    assert llmc.split_of("evaluation_train_1.bin") == "train"


def test_llmc_ids_past_gpt2s_vocabulary_are_refused_naming_file_and_offset(tmp_path):
    tokens = np.arange(1000) % 50257
    tokens[777] = 50300
    write_llmc(tmp_path / "x_train_000001.bin", tokens)
    write_llmc(tmp_path / "x_val_000000.bin", [1, 2, 3])
    message = refused([tmp_path / "x_train_000001.bin", tmp_path / "x_val_000000.bin"],
                      tmp_path, "--tokenizer", "gpt2")
    assert message == (f"{tmp_path}/x_train_000001.bin: token 777 (byte offset 2,578) is 50300, "
                       "not a GPT-2 id (below 50257): not an llm.c GPT-2 shard; convert it with a "
                       "GPT-2 tokenizer or remove it from the sources")


# --- settings a job would ignore -----------------------------------------------------------------


def test_settings_llmc_shards_would_ignore_are_refused(tmp_path):
    write_llmc(tmp_path / "x_train_000001.bin", [1, 2, 3])
    write_llmc(tmp_path / "x_val_000000.bin", [1, 2, 3])
    shards = [tmp_path / "x_train_000001.bin", tmp_path / "x_val_000000.bin"]
    assert refused(shards, tmp_path, "--val-fraction", "0.1", "--vocab-size", "300",
                   "--text-field", "body") == (
        "the sources are llm.c shards, GPT-2 tokens already and split by their names (*_val_*): "
        "--tokenizer byte, --text-field body, --vocab-size 300, --val-fraction 0.1 do not apply "
        "to them; drop them")


def test_bpe_settings_without_a_bpe_to_train_are_refused(tmp_path):
    (tmp_path / "a.txt").write_text("some text")
    assert refused([tmp_path / "a.txt"], tmp_path, "--vocab-size", "300", "--bpe-train-mb",
                   "1") == ("--vocab-size 300, --bpe-train-mb 1 shape the bpe tokenizer prepare "
                            "trains, and --tokenizer byte trains none; drop them")


def test_a_merge_takes_its_parts_split_and_refuses_their_settings(tmp_path, capsys):
    """Parts prepared with --val-fraction 0.25 and --shard-tokens 64: the merge applies them (it
    used its own defaults, silently); a merge that says otherwise, or gives a setting of the
    parts' encoding, is refused."""
    (tmp_path / "src").mkdir()
    write_parquet(tmp_path / "src" / "a.parquet", docs_named("m", 16), row_group_size=2)
    for i in (1, 2):  # 8 units, 4 each
        prepare.run(PrepareConfig(sources=[str(tmp_path / "src")], out=str(tmp_path / f"part{i}"),
                                  tokenizer="byte", part=f"{i}/2", val_fraction=0.25,
                                  shard_tokens=64, workers=1))
    parts = [str(tmp_path / "part1"), str(tmp_path / "part2")]
    merged = run(parts, tmp_path / "merged", merge=True, workers=0)
    whole = run([tmp_path / "src"], tmp_path / "whole", tokenizer="byte", val_fraction=0.25,
                shard_tokens=64)
    assert merged.shards == whole.shards  # the same files, tokens and hashes
    assert merged.meta["source"]["val_fraction"] == 0.25
    message = run_cli("prepare", *parts, "--merge", "--val-fraction", "0.5", "--out",
                      tmp_path / "m2").stderr
    assert message == ("ddpgpt: error: --merge --val-fraction 0.5: the parts were prepared with "
                       "--val-fraction 0.25; give one of them (or none: the parts' applies)\n")
    message = run_cli("prepare", *parts, "--merge", "--tokenizer", "gpt2", "--workers", "2",
                      "--out", tmp_path / "m3").stderr
    assert message == ("ddpgpt: error: --merge assembles the parts' encoded units: --tokenizer "
                       "gpt2, --workers 2 do not apply to it (the tokenizer, text field and "
                       "workers were the parts'); drop them\n")


# --- parquet text columns ------------------------------------------------------------------------


@pytest.mark.parametrize("values, kind", [([1, 2], "int64"), ([b"a", b"b"], "binary"),
                                          ([["a"], ["b"]], "list<element: string>")])
def test_a_parquet_text_column_that_is_not_text_is_one_line(tmp_path, values, kind):
    write_parquet(tmp_path / "a.parquet", values, row_group_size=2)
    assert refused([tmp_path / "a.parquet"], tmp_path) == (
        f"{tmp_path}/a.parquet: column 'text' holds {kind} values, not text; name the text "
        "column with --text-field")


def test_a_parquet_column_of_messages_read_as_text_says_chat(tmp_path):
    """A list of {role, content} records is a conversation: the line says --chat (a list of
    strings is not, and its line does not)."""
    messages = [[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yes"}]] * 2
    write_parquet(tmp_path / "a.parquet", messages, row_group_size=2)
    assert refused([tmp_path / "a.parquet"], tmp_path) == (
        f"{tmp_path}/a.parquet: column 'text' holds list<element: struct<role: string, content: "
        "string>> values, not text (conversations: prepare them with --chat); name the text "
        "column with --text-field")


def test_null_parquet_rows_are_counted_as_null_rows(tmp_path, capsys):
    texts = ["first", None, "", "fourth", None]
    write_parquet(tmp_path / "a.parquet", texts, row_group_size=2)
    ds = run([tmp_path / "a.parquet"], tmp_path / "o", tokenizer="byte", val_fraction=0.5)
    assert_stream(ds, byte_oracle(["first", "fourth"], 0.5))
    stats = ds.meta["source"]["stats"]
    assert (stats["null_rows"], stats["skipped_empty"], stats["documents"]) == (2, 1, 2)
    out = capsys.readouterr().out
    assert "skipped 0 binary and 1 empty files" in out and "skipped 2 null rows (no text)" in out


# --- a full disk ---------------------------------------------------------------------------------


@pytest.mark.e2e
@pytest.mark.timeout(300)
@pytest.mark.parametrize("size_kb, workers, writer", [(150, 2, "worker"),
                                                      (900, 1, "assembler")])
def test_a_full_disk_is_one_line_naming_the_file_and_the_space(tmp_path, size_kb, workers,
                                                               writer):
    """--out on a tmpfs too small for a parquet of 8 row groups (8 units of 200 KB of uint16
    byte tokens, 1.6 MB of shards): at 150 KB a worker's first unit file hits ENOSPC; at 900 KB
    the assembler's shard does, in its fourth unit (three are committed). One line: the file,
    the space free, about how much more the dataset needs; exit 1; no traceback; what was done
    is kept (and only then said to be)."""
    from tests.dist.test_recovery_one_node import mount_namespace

    prefix = mount_namespace()
    if prefix is None:
        pytest.skip("cannot mount a tmpfs here (needs root or user namespaces)")
    src = tmp_path / "src"
    src.mkdir()
    rng = np.random.default_rng(0)
    texts = ["".join(rng.choice(list("abcdefgh \n"), 2000)) for _ in range(400)]
    write_parquet(src / "a.parquet", texts, row_group_size=50)
    disk = tmp_path / "disk"
    disk.mkdir()
    script = (f'mount -t tmpfs -o size={size_kb}k tmpfs "$0" && "$@"; code=$?; '
              'cp -r "$0" "$0.copy"; exit $code')
    cmd = [*prefix, "sh", "-c", script, str(disk), sys.executable, "-m", "ddpgpt", "prepare",
           str(src), "--tokenizer", "byte", "--workers", str(workers), "--out",
           str(disk / "data")]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert result.returncode == 1, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    line = lines[0]
    assert line.startswith(f"ddpgpt: error: cannot write {disk}/.data.partial/")
    wrote = line.split("cannot write ", 1)[1].split(":", 1)[0]
    assert wrote.endswith(".tok" if writer == "worker" else "train_000000.bin"), line
    kept = f"What is done is kept in {disk}/.data.partial: free space" if writer == "assembler" \
        else "Nothing was done yet: free space (or give --out on another disk)"
    assert ": No space left on device (ENOSPC); " in line and " MB free there, and the dataset " \
        "needs about " in line and line.endswith(
            f" MB more. {kept}, then run the same command again to continue")
    needed = float(line.split("needs about ")[1].split(" MB")[0])
    partial = tmp_path / "disk.copy" / ".data.partial"
    written = sum(p.stat().st_size - 1024 for p in partial.glob("*_*.bin"))
    assert (written > 0) == (writer == "assembler") == partial.is_dir()  # kept if anything done
    if writer == "assembler":  # the rate of the 3 units assembled: the 1.6 MB, less written
        assert json.loads((partial / "progress.json").read_text())["units"] == 3
        assert needed + written / 1e6 == pytest.approx(1.6008, abs=0.01)
    else:  # before any unit: one token (2 bytes) per byte of the inputs
        assert needed == pytest.approx(2 * (src / "a.parquet").stat().st_size / 1e6, abs=0.06)

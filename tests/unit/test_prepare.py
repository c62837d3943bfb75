"""`ddpgpt prepare` on a small corpus the test writes: nested dirs, Latin-1, binary, empty files."""

import json
import sys

import numpy as np
import pytest

from ddpgpt.config.commands import PrepareConfig
from ddpgpt.data.prepare import main as prepare
from ddpgpt.data.prepare.assemble import is_val
from ddpgpt.data.shards import TokenDataset
from ddpgpt.data.tokenizer import ByteTokenizer, load_tokenizer
from ddpgpt.errors import UserError
from tests.processes import run_cli

LATIN1 = "# caf\xe9 cr\xe8me br\xfbl\xe9e\nprint('ol\xe1')\n"


@pytest.fixture
def corpus(tmp_path):
    root = tmp_path / "corpus"
    (root / "pkg" / "sub").mkdir(parents=True)
    (root / ".hidden").mkdir()
    docs = {
        "a.py": "def add(a, b):\n    return a + b\n" * 20,
        "pkg/__init__.py": "from .mod import *\n",
        "pkg/mod.py": "class Thing:\n    '''A thing, \u2713 unicode.'''\n    x = 1\n" * 15,
        "pkg/sub/deep.txt": "the quick brown fox jumps over the lazy dog\n" * 30,
        "z_last.md": "# Title\n\nSome prose. " * 25,
    }
    for name, text in docs.items():
        (root / name).write_text(text, encoding="utf-8")
    (root / "pkg" / "latin1.py").write_bytes(LATIN1.encode("latin-1"))
    (root / "pkg" / "blob.bin").write_bytes(b"\x89PNG\x00\x01\x02binary")
    (root / "pkg" / "empty.py").write_bytes(b"")
    (root / ".hidden" / "skipme.txt").write_text("never read")
    return root


def expected_documents(root, raw=False):
    """Documents in the order prepare reads them: sorted walk, binary/empty/hidden skipped;
    as text (invalid UTF-8 replaced), or `raw`: the files' bytes."""
    order = ["a.py", "pkg/__init__.py", "pkg/latin1.py", "pkg/mod.py", "pkg/sub/deep.txt",
             "z_last.md"]
    data = [(root / n).read_bytes() for n in order]
    return data if raw else [d.decode("utf-8", "replace") for d in data]


def run(root, out, **kw):
    prepare.run(PrepareConfig(sources=[str(root)], out=str(out), **kw))
    return TokenDataset(out)


def test_byte_tokenizer_stream_is_exact(corpus, tmp_path, capsys):
    ds = run(corpus, tmp_path / "out", tokenizer="byte", val_fraction=0.3)
    summary = capsys.readouterr().out
    assert "6 documents (4 train, 2 val)" in summary
    assert "skipped 1 binary and 1 empty files" in summary
    # The oracle: EOT before every document, documents split by the documented rule; the
    # tokens are the files' bytes exactly (the Latin-1 file's too).
    expected = {"train": [], "val": []}
    for i, data in enumerate(expected_documents(corpus, raw=True)):
        split = "val" if is_val(i, 300_000) else "train"
        expected[split] += [256] + list(data)
    for split in ("train", "val"):
        np.testing.assert_array_equal(np.concatenate(ds.tokens(split)), expected[split])
    assert ds.vocab_size == 257 and ds.eot_id == 256 and ds.dtype == np.uint16
    assert ds.verify() == 2
    # Each split's bytes of text: its byte tokens less one EOT per document.
    assert ds.split_bytes == {s: len(expected[s]) - expected[s].count(256) for s in expected}


def test_bits_per_byte_of_a_bpe_split(corpus, tmp_path, capsys):
    """bits per byte = nats per token / ln 2 × tokens / bytes, with the split's own counts; a
    dataset without the counts gives None and one line of advice."""
    ds = run(corpus, tmp_path / "out", vocab_size=300, val_fraction=0.3)
    docs = expected_documents(corpus)
    val_bytes = sum(len(d.encode()) for i, d in enumerate(docs) if is_val(i, 300_000))
    assert ds.split_bytes["val"] == val_bytes
    tokens = ds.num_tokens("val")
    assert tokens < val_bytes  # merges: fewer tokens than bytes
    assert ds.bits_per_byte(2.0) == pytest.approx(2.0 / np.log(2) * tokens / val_bytes, rel=1e-12)
    meta = json.loads((ds.path / "meta.json").read_text())
    del meta["bytes"]
    (ds.path / "meta.json").write_text(json.dumps(meta))
    old = TokenDataset(ds.path)
    assert old.bits_per_byte(2.0) is None
    assert old.bytes_advice() == (
        f"dataset {ds.path} has no byte counts in meta.json (prepared by an older ddpgpt), so "
        f"val_bpb is not reported (val_loss is unaffected); prepare it again (ddpgpt prepare ... "
        f"--out {ds.path} --force) to get them")


def test_bpe_round_trip(corpus, tmp_path, capsys):
    ds = run(corpus, tmp_path / "out", vocab_size=300, val_fraction=0.2)
    tok = load_tokenizer(ds.path, "bpe")
    assert ds.tokenizer == "bpe" and ds.vocab_size == tok.vocab_size <= 300
    docs = expected_documents(corpus)
    for text, ids in zip(docs, tok.encode_batch(docs), strict=True):
        assert tok.decode(ids) == text
        assert ids.max() < ds.vocab_size
    # The shards hold exactly the encoded documents, EOT first.
    stream = np.concatenate(ds.tokens("train") + ds.tokens("val"))
    encoded = tok.encode_batch(docs)
    assert len(stream) == sum(len(e) + 1 for e in encoded)
    assert (stream == tok.eot_id).sum() == len(docs)
    meta = json.loads((ds.path / "meta.json").read_text())
    assert meta["source"]["stats"]["skipped_binary"] == 1


def test_byte_decode_round_trip():
    tok = ByteTokenizer()
    text = "caf\xe9 \u2713 \U0001f600 end"
    ids = tok.encode_batch([text])[0]
    assert tok.decode(ids) == text
    assert tok.decode([*ids, tok.eot_id, *ids]) == text + "<|endoftext|>" + text


def test_val_rule_counts():
    for n in (2, 7, 100, 1001):
        for ppm in (10_000, 250_000, 500_000):
            val = [i for i in range(n) if is_val(i, ppm)]
            assert len(val) == -(-n * ppm // 1_000_000) and val[0] == 0


def test_refuses_existing_output_and_force_replaces_atomically(corpus, tmp_path, capsys):
    out = tmp_path / "out"
    run(corpus, out, tokenizer="byte", val_fraction=0.3)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    refused = f"--out {out} exists and is not empty; pass --force to replace it"
    with pytest.raises(UserError, match=refused):
        run(corpus, out, tokenizer="byte", val_fraction=0.3)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(UserError, match="no documents"):  # fails mid-way: old output untouched
        run(empty, out, tokenizer="byte", force=True)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    # no temp dirs left
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus", "empty", "out"]
    run(corpus, out, tokenizer="byte", val_fraction=0.5, force=True)
    assert TokenDataset(out).meta["source"]["val_fraction"] == 0.5


def test_shards_roll_over(corpus, tmp_path, capsys):
    ds = run(corpus, tmp_path / "out", tokenizer="byte", shard_tokens=500, val_fraction=0.3)
    assert len(ds.shards["train"]) > 3
    assert all(s.tokens == 500 for s in ds.shards["train"][:-1])


def test_output_inside_source_is_not_read(corpus, capsys):
    ds = run(corpus, corpus / "out", tokenizer="byte", val_fraction=0.3)
    assert "6 documents" in capsys.readouterr().out
    assert ds.num_tokens("train") + ds.num_tokens("val") == sum(
        len(t) + 1 for t in expected_documents(corpus, raw=True))


def test_hf_source_without_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import fails as if not installed
    with pytest.raises(UserError) as e:
        prepare.run(PrepareConfig(sources=["hf:roneneldan/TinyStories"], out=str(tmp_path / "o"),
                                  tokenizer="byte"))
    assert str(e.value) == ("source hf:roneneldan/TinyStories needs datasets: "
                            "pip install 'ddpgpt[hf]'")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("args, message", [
    (["{tmp}/missing", "--out", "{tmp}/o"],
     "source '{tmp}/missing' does not exist; give a file, a directory, a glob, stdlib or hf:NAME"),
    (["{tmp}/emptydir", "--out", "{tmp}/o"],
     "no documents in {tmp}/emptydir (0 binary and 1 empty files skipped); "
     "give a source with text"),
    (["{corpus}", "--out", "{tmp}/o", "--vocab-size", "100"],
     "--vocab-size 100 is too small: a byte-level BPE needs at least 257 (256 bytes + "
     "end-of-text); use e.g. --vocab-size 4096"),
    (["{corpus}", "--out", "{tmp}/o", "--val-fraction", "1.5"],
     "invalid config: --val-fraction 1.5 must be between 0 and 1"),
    (["{corpus}", "--out", "{tmp}/o", "--tokenizer", "wordpiece"],
     "invalid config: prepare.tokenizer = 'wordpiece'; choose one of bpe, byte, gpt2"),
    (["--verify", "{tmp}/missing"],
     "dataset {tmp}/missing does not exist; create it with: ddpgpt prepare --out {tmp}/missing"),
])
def test_cli_errors(corpus, tmp_path, args, message):
    (tmp_path / "emptydir").mkdir()
    (tmp_path / "emptydir" / "e.txt").write_text("")
    (tmp_path / "onedoc").mkdir()
    (tmp_path / "onedoc" / "d.txt").write_text("only one")
    fill = {"tmp": tmp_path, "corpus": corpus}
    result = run_cli("prepare", *[a.format(**fill) for a in args])
    assert result.returncode == 2
    assert result.stderr == f"ddpgpt: error: {message.format(**fill)}\n"
    assert not (tmp_path / "o").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_cli_prepare_and_verify(corpus, tmp_path):
    out = tmp_path / "o"
    result = run_cli("prepare", corpus, "--out", out, "--tokenizer", "byte",
                     "--val-fraction", "0.3")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"prepared {out}: 6 documents (4 train, 2 val)")
    result = run_cli("prepare", "--verify", out)
    assert result.returncode == 0 and result.stdout.startswith(f"{out}: ok (2 shards,")
    shard = out / "train_000000.bin"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    result = run_cli("prepare", "--verify", out)
    assert result.returncode == 2
    assert result.stderr.startswith(f"ddpgpt: error: {shard}: sha256 mismatch (file ")
    assert result.stderr.count("\n") == 1


def test_a_val_split_of_a_few_documents_is_warned_of(tmp_path, capsys):
    """2 documents in val of 6: the val loss will be theirs alone, said once on stderr; 10 of
    20 is enough to say nothing."""
    for n in range(20):
        (tmp_path / "src" / str(n < 6)).mkdir(parents=True, exist_ok=True)
        (tmp_path / "src" / str(n < 6) / f"{n:02d}.txt").write_text(f"document {n}\n" * 9)
    run(tmp_path / "src" / "True", tmp_path / "few", tokenizer="byte", val_fraction=0.3)
    assert capsys.readouterr().err == (
        "ddpgpt: warning: the val split is 2 documents (--val-fraction 0.3 of 6): its loss is "
        "theirs alone and says little of the rest; a larger --val-fraction holds out more\n")
    run(tmp_path / "src", tmp_path / "enough", tokenizer="byte", val_fraction=0.5)
    said = capsys.readouterr()
    assert "10 val)" in said.out and said.err == ""

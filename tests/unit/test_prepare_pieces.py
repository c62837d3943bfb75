"""Documents larger than a piece: read, encoded and written in pieces, with the same output and
memory bounded by the batch, not the document."""

import random
import time
import tracemalloc

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from ddpgpt.config.commands import PrepareConfig
from ddpgpt.data import tokenizer
from ddpgpt.data.formats import base
from ddpgpt.data.formats import text as text_format
from ddpgpt.data.formats.base import UnitStats
from ddpgpt.data.prepare import main as prepare
from ddpgpt.data.prepare import units
from ddpgpt.data.prepare.assemble import is_val
from ddpgpt.data.shards import TokenDataset
from ddpgpt.data.tokenizer import EOT_TEXT, BPETokenizer, load_tokenizer

CODE = "def f(x):\n    return x  # \u2713 caf\xe9\n\n\tclass A:  pass\r\n" * 40


def small_pieces(monkeypatch, piece_chars, batch_bytes=None):
    # raising=False: the same test runs (and fails) on a prepare without pieces
    monkeypatch.setattr(base, "PIECE_CHARS", piece_chars)
    monkeypatch.setattr(units, "BATCH_BYTES", batch_bytes or 4 * piece_chars)


def run(sources, out, **kw):
    prepare.run(PrepareConfig(sources=[str(s) for s in sources], out=str(out), **kw))
    return TokenDataset(out)


def oracle_split(docs, fraction, encode, eot):
    """The documented stream: EOT then the document's tokens, whole documents to each split."""
    out = {"train": [], "val": []}
    for i, doc in enumerate(docs):
        out["val" if is_val(i, round(fraction * 1e6)) else "train"] += [eot, *encode(doc)]
    return out


def random_bytes(rng, alphabet, n):
    """`n` picks from `alphabet`: UTF-8 sequences, whole, cut or invalid, in any order."""
    return b"".join(rng.choice(alphabet) for _ in range(n))


UTF8_SOUP = [b"a", b" ", b"\n", b"\xc3\xa9", b"\xe2\x9c\x93", b"\xf0\x9f\x98\x80", b"\xff", b"\x80",
             b"\xc3", b"\xe2\x9c"]


@pytest.mark.parametrize("piece_chars", [5, 64, 1 << 20])
def test_byte_stream_is_the_files_bytes_whatever_the_pieces(tmp_path, monkeypatch, capsys,
                                                            piece_chars):
    """The oracle: each kept file's bytes exactly (invalid UTF-8 too), EOT before each; one EOT
    per document however many pieces it has."""
    small_pieces(monkeypatch, piece_chars)
    files = {
        "a_code.py": CODE.encode(),
        "b_oneline.txt": ("\u00e9\u2713\U0001f600x" * 500).encode(),  # multi-byte, no whitespace
        "c_bad_utf8.txt": random_bytes(random.Random(0), UTF8_SOUP, 3000),
        "d_nul_at_end.txt": b"text " * 100 + b"\x00",  # binary, found after the first block
        "e_tiny.txt": b"x",
        "f_empty.txt": b"",
    }
    (tmp_path / "src").mkdir()
    for name, data in files.items():
        (tmp_path / "src" / name).write_bytes(data)
    ds = run([tmp_path / "src"], tmp_path / "out", tokenizer="byte", val_fraction=0.4)
    kept = ("a_code.py", "b_oneline.txt", "c_bad_utf8.txt", "e_tiny.txt")
    docs = [files[name] for name in kept]
    expected = oracle_split(docs, 0.4, list, 256)
    for split in ("train", "val"):
        np.testing.assert_array_equal(np.concatenate(ds.tokens(split)), expected[split])
    assert "4 documents (2 train, 2 val)" in capsys.readouterr().out
    assert ds.meta["source"]["stats"]["skipped_binary"] == 1


def test_read_decodes_in_chunks_exactly_like_whole(tmp_path, monkeypatch):
    """Invalid UTF-8 and characters cut by a chunk boundary decode as in one piece, and the
    replacements counted are those of the whole (a real U+FFFD in the file is not one)."""
    monkeypatch.setattr(base, "PIECE_CHARS", 7)
    rng = random.Random(1)
    for trial in range(50):
        data = random_bytes(rng, UTF8_SOUP + [b"\xef\xbf\xbd"], rng.randrange(1, 100))
        path = tmp_path / f"{trial}.txt"
        path.write_bytes(data)
        stats = UnitStats()
        text = "".join(text_format.read_bytes_or_text(path, False, stats))
        assert text == data.decode("utf-8", "replace")
        assert stats.replaced == text.count("\ufffd") - data.count(b"\xef\xbf\xbd")
        assert b"".join(text_format.read_bytes_or_text(path, True, stats)) == data


WORDS = ["ab", " ", "\n", "  ", "\t", "x'", "'s", "9", "\u2713", "!!", "\r\n", "\u00a0", "\u2003",
         "\x1c"]


def test_pieces_cut_before_a_word_keep_the_pre_tokens():
    """Cuts are at most `size` apart; a cut before a whitespace character that precedes a
    non-space (a newline first) leaves the byte-level pre-tokens exactly as in the whole text."""
    level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    rng = random.Random(2)
    for _ in range(200):
        text = "".join(rng.choice(WORDS) for _ in range(rng.randrange(1, 300)))
        size = rng.randrange(4, 60)
        pieces = list(base.cut([text[:37], text[37:]], size))
        assert "".join(pieces) == text and all(0 < len(p) <= size for p in pieces)
        forced = [p for p in pieces[:-1] if len(p) == size]
        if not forced:
            assert [t for p in pieces for t, _ in level.pre_tokenize_str(p)] == \
                [t for t, _ in level.pre_tokenize_str(text)]


def peak_allocated(tmp_path, name, mib):
    """Peak of Python and numpy allocations while preparing one line of `mib` MiB (plus a
    small document for the other split)."""
    src = tmp_path / name
    src.mkdir()
    (src / "a.txt").write_bytes(b"0123456789abcdef" * (mib << 16))
    (src / "b.txt").write_bytes(b"small")
    tracemalloc.start()
    try:
        ds = run([src], tmp_path / f"{name}-out", tokenizer="byte", val_fraction=0.5)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert ds.num_tokens("val") == (mib << 20) + 1
    return peak


def test_memory_is_bounded_by_the_batch_not_the_document(tmp_path, monkeypatch, capsys):
    """Four times the document, the same peak: a few batches of 256 KiB (and the 4 MiB blocks
    that hash a shard), where reading and encoding a document whole took ~10x the document."""
    small_pieces(monkeypatch, 64 << 10, batch_bytes=256 << 10)
    small, large = peak_allocated(tmp_path, "small", 4), peak_allocated(tmp_path, "large", 16)
    assert large - small < 1 << 20, f"peak {small / 2**20:.1f} MiB -> {large / 2**20:.1f} MiB"
    assert large < 12 << 20


def old_style_bpe(docs, vocab_size):
    """The bpe tokenizer as prepare trained it before pieces and the pre-token cap: whole
    documents, byte-level pre-tokens of any length."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT_TEXT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(docs, trainer)
    return tok


@pytest.mark.parametrize("piece_chars", [1 << 20, 211])
def test_bpe_tokens_are_as_before_for_normal_documents(tmp_path, monkeypatch, capsys, piece_chars):
    """Documents of ordinary text give the same vocabulary and tokens as before: whole (smaller
    than a piece), and in pieces cut before a word (which keep every pre-token)."""
    small_pieces(monkeypatch, piece_chars)
    prose = "The quick brown fox's jumps.\n\n  Over 42 lazy dogs!\n" * 30
    docs = [CODE, prose, "x = [1, 2, 3]\n" * 50]
    src = tmp_path / "src"
    src.mkdir()
    for i, doc in enumerate(docs):
        (src / f"{i}.txt").write_text(doc, newline="")
    ds = run([src], tmp_path / "out", vocab_size=400, val_fraction=0.3)
    old = old_style_bpe(docs, 400)
    assert load_tokenizer(ds.path, "bpe")._tok.get_vocab() == old.get_vocab()
    expected = oracle_split(docs, 0.3, lambda doc: old.encode(doc, add_special_tokens=False).ids,
                            ds.eot_id)
    for split in ("train", "val"):
        np.testing.assert_array_equal(np.concatenate(ds.tokens(split)), expected[split])


def test_bpe_on_a_long_line_without_whitespace_is_linear(tmp_path, monkeypatch, capsys):
    """256 KB of letters is one GPT-2 pre-token: BPE work on it grows with its square (a minute
    to train before the cap). Cut every MAX_PRETOKEN_CHARS, it takes about a second; cut into
    pieces too, its tokens still decode to the line."""
    small_pieces(monkeypatch, 64 << 10)
    letters = "".join(random.Random(3).choices("abcdefghijklmnopqrstuvwxyz", k=256_000))
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text(letters)
    (src / "b.txt").write_text("a small document\n")
    start = time.process_time()  # CPU time, every thread's: what the work costs, at any load
    ds = run([src], tmp_path / "out", val_fraction=0.5)
    assert time.process_time() - start < 10
    tok = load_tokenizer(ds.path, "bpe")
    assert tok.decode(ds.tokens("val")[0][1:]) == letters
    cap = tokenizer.MAX_PRETOKEN_CHARS
    pre_tokens = tok._tok.pre_tokenizer.pre_tokenize_str(letters[:cap * 2 + 5])
    assert [len(text) for text, _ in pre_tokens] == [cap, cap, 5]


def test_capped_pre_tokens_are_gpt2s_below_the_cap():
    """The bpe tokenizer's pre-tokens (strings and offsets) are ByteLevel's own wherever no run
    reaches the cap: every class of GPT-2's pattern, contractions, Unicode, all whitespace kinds."""
    capped = BPETokenizer.train(["x"], 300, show_progress=False)._tok.pre_tokenizer
    level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    parts = ["ab", "\u00e9t\u00e9", "\u4e2d\u6587", "42", "\u0663", " ", "  ", "\n", "\t", "\r\n",
             "\u00a0", "\u2003", "'s", "'ll", "'re", "'x", "!!", "+=", "\U0001f600", "_", "-"]
    rng = random.Random(4)
    for _ in range(300):
        text = "".join(rng.choice(parts) for _ in range(rng.randrange(1, 60)))
        assert capped.pre_tokenize_str(text) == level.pre_tokenize_str(text), repr(text)

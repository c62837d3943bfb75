"""A new input format is its file and its row: tests/e2e/toy_format.py adds both from outside the
package, and `prepare` plans, encodes (on this process and on spawned workers), splits and
records its files like a built-in format's, refuses the settings it declares it does not take,
and mixes with the built-in formats in the corpus's order."""

import json
import subprocess
import sys

import numpy as np
import pytest

from ddpgpt.data.formats import table
from ddpgpt.data.prepare.assemble import is_val
from ddpgpt.data.shards import TokenDataset
from tests.e2e import toy_format
from tests.helpers import REPO

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]
DECK_A = "Zen is a card.\n%%\ncaf\u00e9 \u2713 words\nand lines\n%%\n%%\nthe last card\n"
DECK_B = "%%\nbeta one\n%%\nbeta two\n"
NOTES = "a plain text file, one document\n"


def toy_prepare(*args, timeout: float = 240) -> subprocess.CompletedProcess:
    """`ddpgpt prepare ARGS` with the toy format registered first."""
    return subprocess.run([sys.executable, "-m", "tests.e2e.toy_format", "prepare",
                           *map(str, args)], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture
def decks(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.cards").write_text(DECK_A, encoding="utf-8")
    (src / "b.cards").write_text(DECK_B, encoding="utf-8")
    (src / "c.txt").write_text(NOTES, encoding="utf-8")
    return src


def oracle(fraction: float) -> tuple[dict, list[str]]:
    """The documented stream under the byte tokenizer: the decks' non-blank cards, then the text
    file, each EOT then its UTF-8 bytes, whole documents to a split by is_val."""
    docs = [c for deck in (DECK_A, DECK_B) for c in toy_format.cards(deck) if c] + [NOTES]
    out = {"train": [], "val": []}
    for i, doc in enumerate(docs):
        out["val" if is_val(i, round(fraction * 1e6)) else "train"] += [256, *doc.encode()]
    return out, docs


@pytest.mark.parametrize("workers", [1, 2])
def test_a_format_added_from_outside_prepares_a_dataset(decks, tmp_path, workers):
    out = tmp_path / f"out{workers}"
    result = toy_prepare(decks, "--out", out, "--tokenizer", "byte", "--val-fraction", 0.3,
                         "--workers", workers)
    assert result.returncode == 0, result.stderr
    expected, docs = oracle(0.3)
    ds = TokenDataset(out)
    for split in ("train", "val"):
        np.testing.assert_array_equal(np.concatenate(ds.tokens(split)), expected[split])
    meta = json.loads((out / "meta.json").read_text())
    assert [f["path"] for f in meta["source"]["files"]] == \
        [str(decks / n) for n in ("a.cards", "b.cards", "c.txt")]
    stats = meta["source"]["stats"]
    assert (stats["documents"], stats["skipped_empty"]) == (len(docs), 2)  # two blank cards
    assert f"prepared {out}: {len(docs)} documents" in result.stdout


def test_a_format_refuses_the_settings_it_does_not_take(decks, tmp_path):
    (decks / "c.txt").unlink()
    out = tmp_path / "out"
    result = toy_prepare(decks, "--out", out, "--tokenizer", "byte", "--text-field", "body")
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        "ddpgpt: error: the sources are cards sources: --text-field body does not apply to "
        "them; drop it"]
    assert not out.exists() and not (tmp_path / ".out.partial").exists()
    (decks / "c.txt").write_text(NOTES)  # a text file takes --text-field: nothing refused
    result = toy_prepare(decks, "--out", out, "--tokenizer", "byte", "--text-field", "body")
    assert result.returncode == 0, result.stderr


def test_a_file_goes_to_the_format_that_claims_it(monkeypatch, tmp_path):
    deck = tmp_path / "x.cards"
    assert table.file_format(deck) is table.FORMATS["text"]  # unknown: text, as any file
    monkeypatch.setitem(table.FORMATS, "cards", toy_format.ROW)
    assert table.file_format(deck) is toy_format.ROW
    assert table.file_format(tmp_path / "x.jsonl") is table.FORMATS["jsonl"]


def test_the_package_does_not_know_the_toy_format():
    """Nothing under ddpgpt/ names it: the file and the row are all there is."""
    assert not [p for p in (REPO / "ddpgpt").rglob("*.py") if "cards" in p.read_text()]

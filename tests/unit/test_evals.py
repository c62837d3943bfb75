"""Multiple-choice scoring against an independent implementation of llm.c's HellaSwag definition
(tests/hellaswag_oracle.py), with each tokenizer a run can have and with rows longer than the
block; every bad task file as its one FILE:LINE line; HellaSwag's download, cache and offline
message."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ddpgpt.config.model import ModelConfig
from ddpgpt.data.tokenizer import BPETokenizer, ByteTokenizer, GPT2Tokenizer
from ddpgpt.distributed.group import DistEnv
from ddpgpt.errors import DataError, UserError
from ddpgpt.evals import tasks
from ddpgpt.evals.multiple_choice import ending_losses, render
from ddpgpt.evals.scorer import Scorer
from ddpgpt.model.gpt import GPT
from tests import hellaswag_oracle as oracle

pytestmark = pytest.mark.usefixtures("one_thread")
TIKTOKEN = Path(__file__).resolve().parents[3] / "shared" / "data" / "tiktoken-gpt2"


def _bpe() -> BPETokenizer:
    words = " ".join(oracle.write_examples.__doc__.split())  # any small English text
    return BPETokenizer.train([words * 20, "a man is sitting on the roof " * 50], 300,
                              show_progress=False)


def _gpt2(monkeypatch) -> GPT2Tokenizer:
    pytest.importorskip("tiktoken")
    if not TIKTOKEN.is_dir():
        pytest.skip("no offline copy of GPT-2's tiktoken files")
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(TIKTOKEN))
    return GPT2Tokenizer()


@pytest.mark.parametrize("kind", ["byte", "bpe", "gpt2"])
def test_scores_equal_llm_c_definition_with_every_tokenizer(tmp_path, monkeypatch, kind):
    """Per-ending losses within 1e-5 of the oracle's and the same accuracies, with the block
    short enough that a third of the rows are cut to their last block tokens."""
    tok = {"byte": ByteTokenizer, "bpe": _bpe, "gpt2": lambda: _gpt2(monkeypatch)}[kind]()
    block = 24
    model = GPT(ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=block,
                            vocab_size=tok.vocab_size), seed=3).eval()
    rows = oracle.write_examples(tmp_path / "mc.jsonl", 24, seed=1)
    task = tasks.load("mine", str(tmp_path / "mc.jsonl"))

    def encode(text):  # the tokenizer's own library, not ddpgpt's encode_batch
        if kind == "byte":
            return list(text.encode())
        if kind == "bpe":
            return tok._tok.encode(text, add_special_tokens=False).ids
        return tok._enc.encode_ordinary(text)

    cut = 0
    for example, row in zip(task.examples, rows):
        sums, counts = ending_losses(model, render(example, tok, block), torch.device("cpu"))
        ref_sums, ref_means = oracle.ending_losses(
            model, encode(row["ctx"]), [encode(" " + e) for e in row["endings"]], block)
        assert sums.tolist() == pytest.approx(ref_sums, abs=1e-5)
        assert (sums / counts).tolist() == pytest.approx(ref_means, abs=1e-5)
        cut += len(encode(row["ctx"])) >= block
    assert cut >= 6  # the truncation is exercised
    ours = Scorer([task], tok, block, DistEnv()).score(model)
    ref = oracle.accuracy(model, rows, encode, block)
    assert (ours["mine_acc_norm"], ours["mine_acc"], ours["mine_n"]) == \
        (ref["acc_norm"], ref["acc"], ref["n"])


def test_an_ending_longer_than_the_block_scores_its_last_tokens():
    """Context and ending of 30 bytes, block 8: the row keeps its last 8 tokens, all of the
    ending's, and the 7 that have a token before them are scored."""
    tok, block = ByteTokenizer(), 8
    r = render(tasks.Example("x" * 30, ("y" * 29, "z" * 29), 0), tok, block)
    assert r.inputs.shape == (2, 7) and (r.targets >= 0).sum(1).tolist() == [7, 7]
    assert r.inputs[0].tolist() == [ord("y")] * 7 and r.targets[0].tolist() == [ord("y")] * 7
    short = render(tasks.Example("ab", ("c", "de"), 1), tok, block)
    # " c" after "ab": 4 tokens, 3 inputs, 2 scored; " de": 5 tokens, 3 scored; padded with -1
    assert short.targets.tolist() == [[-1, ord(" "), ord("c"), -1],
                                      [-1, ord(" "), ord("d"), ord("e")]]


BAD = [
    ("not json", "not JSON"),
    ("[1, 2]", "a JSON list, not an object"),
    ('{"ctx": "a", "endings": ["b", "c"]}', "missing field label"),
    ('{"endings": ["b", "c"], "label": 0}', "missing field ctx"),
    ('{"ctx": 3, "endings": ["b", "c"], "label": 0}', "ctx is a int, not a string"),
    ('{"ctx": " ", "endings": ["b", "c"], "label": 0}', "ctx is empty"),
    ('{"ctx": "a", "endings": "bc", "label": 0}', "endings must be a list of at least 2 strings"),
    ('{"ctx": "a", "endings": ["b"], "label": 0}', "endings must be a list of at least 2"),
    ('{"ctx": "a", "endings": ["b", 4], "label": 0}', "endings must be a list of at least 2"),
    ('{"ctx": "a", "endings": ["b", ""], "label": 0}', "ending 1 is empty"),
    ('{"ctx": "a", "endings": ["b", "c"], "label": 2}',
     "label 2 is not an index into the 2 endings (0 to 1)"),
    ('{"ctx": "a", "endings": ["b", "c"], "label": -1}', "label -1 is not an index"),
    ('{"ctx": "a", "endings": ["b", "c"], "label": true}', "label True is not an index"),
    ('{"ctx": "a", "endings": ["b", "c"], "label": "x"}', "label 'x' is not an index"),
    ('{"ctx": "a", "endings": ["b", "c"], "label": "\u00b2"}', "label '\u00b2' is not an index"),
]


@pytest.mark.parametrize("line, what", BAD, ids=[w.split(" (")[0][:40] for _, w in BAD])
def test_each_bad_line_is_named_by_file_and_line(tmp_path, line, what):
    path = tmp_path / "task.jsonl"
    good = '{"ctx": "a", "endings": ["b", "c"], "label": 1}'
    path.write_text(f"{good}\n\n{line}\n{good}\n")  # the blank line 2 is skipped, counted
    with pytest.raises(DataError) as e:
        tasks.read(path)
    message = str(e.value)
    assert message.startswith(f"{path}:3: {what}") and "\n" not in message
    assert message.endswith('each line must be {"ctx": "...", "endings": ["...", ...], '
                            '"label": INDEX}')


def test_a_line_that_is_not_utf8_is_named_by_its_number(tmp_path):
    path = tmp_path / "task.jsonl"
    good = b'{"ctx": "a", "endings": ["b", "c"], "label": 1}'
    path.write_bytes(good + b"\n" + good + b"\n" + b'{"ctx": "caf\xe9", "endings": ["b", "c"], '
                     b'"label": 0}\n')
    with pytest.raises(DataError) as e:
        tasks.read(path)
    assert str(e.value) == (f"{path}:3: not UTF-8 (byte 0xe9 at column 13); save the file as "
                            "UTF-8")


def test_a_missing_or_empty_file_and_bad_task_lists(tmp_path):
    with pytest.raises(DataError, match=f"^{tmp_path}/none.jsonl: no such task file"):
        tasks.read(tmp_path / "none.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DataError, match="empty.jsonl: no examples"):
        tasks.read(tmp_path / "empty.jsonl")
    with pytest.raises(UserError, match="^--task piqa: only hellaswag downloads itself; give "):
        tasks.pairs("piqa", "", "--task", "--task-data")
    with pytest.raises(UserError, match=r"^--task-data names 1 file\(s\) for the 2 task\(s\)"):
        tasks.pairs("hellaswag,piqa", "p.jsonl", "--task", "--task-data")
    with pytest.raises(UserError, match="task name 'PIQA' must be lower-case"):
        tasks.pairs("PIQA", "p.jsonl", "--task", "--task-data")
    assert tasks.pairs("hellaswag,piqa", ",p.jsonl", "--task", "--task-data") == \
        [("hellaswag", ""), ("piqa", "p.jsonl")]


def test_hellaswag_downloads_once_checked_and_cached(tmp_path, monkeypatch):
    """A file:// URL stands in for GitHub; its content hash is made the expected one."""
    source = tmp_path / "served.jsonl"
    oracle.write_examples(source, 5, seed=2)
    monkeypatch.setenv("DDPGPT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(tasks, "HELLASWAG_URL", source.as_uri())
    monkeypatch.setattr(tasks, "HELLASWAG_BLOB", tasks.blob_id(source.read_bytes()))
    task = tasks.load("hellaswag", "", limit=3)
    assert len(task.examples) == 3 and task.source == str(tmp_path / "cache" /
                                                            "hellaswag_val.jsonl")
    source.unlink()  # cached: no second download
    assert len(tasks.load("hellaswag", "").examples) == 5
    (tmp_path / "cache" / "hellaswag_val.jsonl").write_text("changed\n")
    with pytest.raises(DataError, match="not HellaSwag's validation set .*; delete it to "):
        tasks.load("hellaswag", "")


def test_a_download_that_is_not_the_file_is_refused_and_not_cached(tmp_path, monkeypatch):
    source = tmp_path / "served.jsonl"
    source.write_text('{"ctx": "a", "endings": ["b", "c"], "label": 0}\n')
    monkeypatch.setenv("DDPGPT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(tasks, "HELLASWAG_URL", source.as_uri())
    with pytest.raises(DataError, match="the download is not HellaSwag's validation set"):
        tasks.load("hellaswag", "")
    assert not (tmp_path / "cache" / "hellaswag_val.jsonl").exists()


def test_offline_is_one_line_naming_the_url_and_task_data(tmp_path, monkeypatch):
    url = "http://127.0.0.1:9/hellaswag_val.jsonl"  # the discard port: refused at once
    monkeypatch.setenv("DDPGPT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(tasks, "HELLASWAG_URL", url)
    with pytest.raises(DataError) as e:
        tasks.load("hellaswag", "")
    assert str(e.value).startswith(f"cannot download HellaSwag's validation set from {url} (")
    assert str(e.value).endswith("download that file where there is a network and give it "
                                 "with --task-data FILE")


def test_the_content_hash_is_gits_blob_id(tmp_path):
    """The id `git hash-object` gives a file: what the HellaSwag repository's tree lists."""
    import subprocess

    path = tmp_path / "f"
    path.write_bytes(b"hello\n\x00\xff")
    git = subprocess.run(["git", "hash-object", str(path)], capture_output=True, text=True)
    if git.returncode:
        pytest.skip("no git")
    assert tasks.blob_id(path.read_bytes()) == git.stdout.strip()

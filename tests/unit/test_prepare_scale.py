"""`ddpgpt prepare` at scale: the shards do not depend on the number of workers, on parts merged
afterwards, or on interruptions (SIGKILL, a crash mid-unit) followed by the same command."""

import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from ddpgpt.config.commands import PrepareConfig
from ddpgpt.data import verify
from ddpgpt.data.prepare import build, output
from ddpgpt.data.prepare import main as prepare
from ddpgpt.data.prepare.assemble import Assembler, is_val
from ddpgpt.data.shards import TokenDataset
from ddpgpt.errors import UserError
from tests.processes import kill_tree

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")


def documents(n, seed=0):
    rng = np.random.default_rng(seed)
    words = ["the", "data", "parallel", "caf\u00e9", "\u2713", "model", "tokens", "of", "a", "42"]
    return [" ".join(rng.choice(words, size=int(rng.integers(5, 60)))) + "\n" for _ in range(n)]


@pytest.fixture
def corpus(tmp_path):
    """Parquet of 12 row groups (12 units), a jsonl and two text files: 14 units."""
    src = tmp_path / "src"
    src.mkdir()
    docs = documents(150)
    pq.write_table(pa.table({"text": docs[:120]}), src / "a.parquet", row_group_size=10)
    (src / "b.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[120:140]))
    for i, d in enumerate(docs[140:142]):
        (src / f"c{i}.txt").write_text(d * 40)
    return src


def digests(path):
    """sha256 of every file of a dataset directory (shards, meta.json, tokenizer.json), but the
    cache of the shards' hashes, which records each file's identity (inode, time) on this disk."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())
            if p.name != verify.CACHE}


def prep(sources, out, **kw):
    kw.setdefault("workers", 1)
    kw.setdefault("val_fraction", 0.1)
    kw.setdefault("shard_tokens", 700)
    prepare.run(PrepareConfig(sources=[str(s) for s in sources], out=str(out), **kw))
    return out


@pytest.mark.timeout(120)
def test_shards_are_byte_identical_for_any_number_of_workers(corpus, tmp_path, capsys):
    one = prep([corpus], tmp_path / "w1", vocab_size=300)
    three = prep([corpus], tmp_path / "w3", vocab_size=300, workers=3)
    assert digests(one) == digests(three)
    assert len([n for n in digests(one) if n.endswith(".bin")]) > 4
    assert TokenDataset(three).verify() > 4


def test_parts_merged_are_the_single_machine_dataset(corpus, tmp_path, capsys):
    whole = prep([corpus], tmp_path / "whole", tokenizer="byte")
    for i in (1, 2, 3):
        prep([corpus], tmp_path / f"part{i}", tokenizer="byte", part=f"{i}/3")
    assert "when every part is done: ddpgpt prepare --merge" in capsys.readouterr().out
    # the parts' tokenizer and the encoding's workers are theirs: a merge takes neither
    merged = prep([tmp_path / "part*"], tmp_path / "merged", merge=True, workers=0)
    assert digests(merged) == digests(whole)
    with pytest.raises(UserError) as e:
        prep([tmp_path / "part1", tmp_path / "part3"], tmp_path / "m2", merge=True, workers=0)
    assert str(e.value) == "--merge: parts [2] of 3 are missing; give each part directory once"


def test_part_refusals(corpus, tmp_path):
    with pytest.raises(UserError) as e:
        prep([corpus], tmp_path / "p", part="1/2")
    assert str(e.value).startswith("--part 1/2 with --tokenizer bpe: each part would train its "
                                   "own tokenizer; prepare one dataset first and pass ")
    with pytest.raises(UserError) as e:
        prep([corpus], tmp_path / "p", part="1/2", tokenizer="byte", max_tokens=10)
    assert str(e.value).startswith("--part 1/2 with --max-tokens: the limit is on the whole")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_max_tokens_is_a_prefix_of_the_stream(corpus, tmp_path, capsys):
    whole = TokenDataset(prep([corpus], tmp_path / "whole", tokenizer="byte", val_fraction=0.2))
    limit = 5_000
    cut = TokenDataset(prep([corpus], tmp_path / "cut", tokenizer="byte", val_fraction=0.2,
                            max_tokens=limit))
    assert f"stopped at --max-tokens {limit:,}" in capsys.readouterr().out
    # The oracle: walk the whole dataset's documents in stream order, stop at `limit` tokens.
    streams = {s: np.concatenate(whole.tokens(s)) for s in ("train", "val")}
    starts = {s: np.flatnonzero(streams[s] == 256).tolist() + [len(streams[s])]
              for s in streams}
    expected, pos, left = {"train": [], "val": []}, {"train": 0, "val": 0}, limit
    for i in range(whole.meta["source"]["stats"]["documents"]):
        split = "val" if is_val(i, 200_000) else "train"
        k = pos[split]
        doc = streams[split][starts[split][k]:starts[split][k + 1]]
        expected[split].append(doc[:left])
        left -= len(expected[split][-1])
        pos[split] += 1
        if left == 0:
            break
    for s in ("train", "val"):
        np.testing.assert_array_equal(np.concatenate(cut.tokens(s)), np.concatenate(expected[s]))


def test_a_crash_mid_unit_then_the_same_command_gives_the_same_dataset(corpus, tmp_path,
                                                                       monkeypatch, capsys):
    """The crash comes half-way through the 7th unit's tokens, after 6 were saved: the shards
    hold bytes beyond what progress.json counts, as after a SIGKILL. The same command cuts them
    back, says where it continues, and ends with the uninterrupted run's bytes."""
    reference = prep([corpus], tmp_path / "ref", tokenizer="byte")
    monkeypatch.setattr(build, "COMMIT_SECONDS", 0.0)
    add = Assembler.add

    def crashing_add(self, tokens, record, mask=None):
        if self.units == 6:
            self._write("train", tokens[:len(tokens) // 2])
            self.writers["train"].sync()
            raise RuntimeError("power cut")
        add(self, tokens, record, mask)

    monkeypatch.setattr(Assembler, "add", crashing_add)
    with pytest.raises(RuntimeError, match="power cut"):
        prep([corpus], tmp_path / "o", tokenizer="byte")
    partial = tmp_path / ".o.partial"
    assert json.loads((partial / "progress.json").read_text())["units"] == 6
    monkeypatch.setattr(Assembler, "add", add)
    capsys.readouterr()
    prep([corpus], tmp_path / "o", tokenizer="byte")
    out = capsys.readouterr().out
    assert out.startswith(f"continuing the prepare in {partial}: 6 of 14 units done, ")
    assert digests(tmp_path / "o") == digests(reference)
    assert not partial.exists()


def test_changed_settings_are_refused_with_how_to_start_over(corpus, tmp_path, monkeypatch):
    monkeypatch.setattr(build, "COMMIT_SECONDS", 0.0)

    def stop_at_3(self, tokens, record, mask=None, add=Assembler.add):
        if self.units == 3:
            raise KeyboardInterrupt
        add(self, tokens, record, mask)

    monkeypatch.setattr(Assembler, "add", stop_at_3)
    with pytest.raises(KeyboardInterrupt):
        prep([corpus], tmp_path / "o", tokenizer="byte")
    monkeypatch.undo()
    partial = tmp_path / ".o.partial"
    with pytest.raises(UserError) as e:
        prep([corpus], tmp_path / "o", tokenizer="byte", val_fraction=0.3)
    assert str(e.value) == (f"--out {tmp_path}/o: {partial} holds an unfinished prepare of other "
                            "sources or settings (val_fraction: 0.1 -> 0.3); run that command "
                            f"again to finish it, or remove {partial} (rm -r) to start over")
    (corpus / "c0.txt").write_text("changed\n")
    with pytest.raises(UserError, match=r"\(the source files changed\); run that command"):
        prep([corpus], tmp_path / "o", tokenizer="byte")
    assert partial.is_dir() and not (tmp_path / "o").exists()


def test_a_second_prepare_into_the_same_out_is_refused(corpus, tmp_path):
    partial = tmp_path / ".o.partial"
    partial.mkdir()
    with output.Lock(partial, tmp_path / "o"):
        with pytest.raises(UserError) as e:
            prep([corpus], tmp_path / "o", tokenizer="byte")
    assert str(e.value) == (f"--out {tmp_path}/o: another prepare is writing it now (into "
                            f"{partial}); wait for it to finish or stop it")
    assert partial.is_dir()


def wait_for(predicate, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def feed(fifo, data):
    """Writes `data` into the FIFO once a reader opens it (in a thread: open blocks till then)."""
    def write():
        with open(fifo, "wb") as f:
            f.write(data)
    thread = threading.Thread(target=write, daemon=True)
    thread.start()
    return thread


def gone(pid: int) -> bool:
    """The process has exited (absent, or a zombie: its files are closed either way)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


@pytest.mark.timeout(120)
@pytest.mark.skip(reason="the continued prepare sometimes waited forever on the FIFO source (1 "
                  "of 3 runs on a 2-core VM, 1 of 1 in a fresh clone's make test) before the "
                  "killed run's processes were waited for; not reproduced since (20 of 20 "
                  "runs at load 3 passed, with and without that wait): kept off until it is")
def test_sigkill_then_the_same_command_continues_to_the_same_dataset(corpus, tmp_path):
    """The last source is a FIFO: the first prepare has saved every unit before it when it is
    killed (-9, workers and all); the second, fed the FIFO's text, continues and ends with the
    bytes of a prepare that was never interrupted. The FIFO is fed only once every process of
    the killed run has exited: a killed worker still in open() on the FIFO counts as its reader
    until it runs again, and text written to it then is lost with it when it exits (the
    continued prepare then waits forever for a writer, as any reader of a FIFO would)."""
    fifo = tmp_path / "zz-last.txt"
    os.mkfifo(fifo)
    text = b"the last document, from a pipe\n" * 50
    argv = [sys.executable, "-m", "ddpgpt", "prepare", str(corpus), str(fifo), "--tokenizer",
            "byte", "--val-fraction", "0.1", "--shard-tokens", "700", "--workers", "2"]
    proc = subprocess.Popen([*argv, "--out", str(tmp_path / "o")], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    progress = tmp_path / ".o.partial" / "progress.json"
    try:
        wait_for(lambda: progress.is_file() and json.loads(progress.read_text())["units"] == 14)
        tree = kill_tree(proc.pid)
        proc.wait(timeout=30)
        wait_for(lambda: all(gone(pid) for pid in tree))
    finally:
        kill_tree(proc.pid)
    thread = feed(fifo, text)
    again = subprocess.run([*argv, "--out", str(tmp_path / "o")], capture_output=True, text=True,
                           timeout=60)
    thread.join(timeout=10)
    assert again.returncode == 0, again.stderr
    assert again.stdout.startswith(f"continuing the prepare in {tmp_path}/.o.partial: 14 of 15 "
                                   "units done, ")
    thread = feed(fifo, text)
    ref = subprocess.run([*argv, "--out", str(tmp_path / "ref")], capture_output=True,
                         text=True, timeout=60)
    thread.join(timeout=10)
    assert ref.returncode == 0, ref.stderr
    assert digests(tmp_path / "o") == digests(tmp_path / "ref")

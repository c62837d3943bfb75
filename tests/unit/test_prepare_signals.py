"""`ddpgpt prepare` stopped by a signal keeps its progress in the partial directory (and says so),
or removes it when nothing was done yet; publishing is never cut in two."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from ddpgpt.config.commands import PrepareConfig
from ddpgpt.data.prepare import main as prepare
from ddpgpt.data.prepare import output
from ddpgpt.data.shards import TokenDataset
from tests.processes import kill_tree


def wait_for(predicate, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def write_corpus(root, mb=12):
    root.mkdir()
    for i in range(mb):
        (root / f"{i:02d}.txt").write_bytes(b"some text to tokenize\n" * ((1 << 20) // 22 + 1))


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP],
                         ids=["INT", "TERM", "HUP"])
def test_a_signal_keeps_the_progress_and_exits_128_plus_its_number(tmp_path, signum):
    """The signal comes once the corpus's two units are in the shards; the last source is a FIFO
    that nobody writes, so the prepare is still running whenever it lands. SIGTERM exits 143,
    Ctrl-C's SIGINT 130."""
    write_corpus(tmp_path / "corpus")
    fifo = tmp_path / "never-ends"
    os.mkfifo(fifo)
    out = tmp_path / "o"
    argv = ["prepare", tmp_path / "corpus", fifo, "--out", out, "--tokenizer", "byte"]
    proc = subprocess.Popen([sys.executable, "-m", "ddpgpt", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    partial = tmp_path / ".o.partial"
    try:
        progress = partial / "progress.json"  # both units of the corpus in, the FIFO's not
        wait_for(lambda: progress.is_file() and json.loads(progress.read_text())["units"] == 2)
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=30)
    finally:
        kill_tree(proc.pid)
    assert proc.returncode == 128 + signum
    assert err == (f"ddpgpt: stopped: {signum.name} before prepare finished; its progress is kept "
                   f"in {partial} (2 of 3 units done; --out {out} is unchanged): run the same "
                   "command again to continue\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".o.partial", "corpus", "never-ends"]
    assert (partial / "progress.json").is_file()


@pytest.fixture
def sigterm_recorder():
    """A SIGTERM handler of the test's own, so a signal never ends the test process."""
    received = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    yield received
    signal.signal(signal.SIGTERM, previous)


def corpus_of_two(tmp_path):
    for name in ("a.txt", "b.txt"):
        (tmp_path / name).write_text(f"document {name}\n")
    return [str(tmp_path / "a.txt"), str(tmp_path / "b.txt")]


def test_sigterm_in_process_raises_terminated_and_restores_the_handler(tmp_path, monkeypatch,
                                                                       sigterm_recorder):
    def signalled_tokenizer(cfg, job, tmp):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler raises before this ends

    monkeypatch.setattr(prepare, "_tokenizer", signalled_tokenizer)
    cfg = PrepareConfig(sources=corpus_of_two(tmp_path), out=str(tmp_path / "o"), tokenizer="byte",
                        val_fraction=0.5)
    with pytest.raises(output.Terminated) as e:
        prepare.run(cfg)
    assert e.value.exit_code == 128 + signal.SIGTERM
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "b.txt"]
    assert sigterm_recorder == []
    assert signal.getsignal(signal.SIGTERM).__name__ == "<lambda>"  # the recorder is back


def test_sigterm_while_publishing_waits_until_the_dataset_is_in_place(tmp_path, monkeypatch,
                                                                      sigterm_recorder, capsys):
    """Publishing is two renames; a signal between them would lose the old --out. It is held and
    passed on to the previous handler once the dataset is complete."""
    publish = output.publish

    def signalled_publish(tmp, out):
        os.kill(os.getpid(), signal.SIGTERM)
        publish(tmp, out)

    monkeypatch.setattr(prepare, "publish", signalled_publish)
    prepare.run(PrepareConfig(sources=corpus_of_two(tmp_path), out=str(tmp_path / "o"),
                              tokenizer="byte", val_fraction=0.5))
    assert TokenDataset(tmp_path / "o").verify() == 2
    assert sigterm_recorder == [signal.SIGTERM]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "b.txt", "o"]

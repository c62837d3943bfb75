"""`ddpgpt prepare --out` that cannot become a dataset directory: one line, exit 2, nothing
created."""

import os
import sys
from pathlib import Path

import pytest

from ddpgpt.config.commands import PrepareConfig
from ddpgpt.data.prepare import main as prepare
from ddpgpt.errors import UserError
from tests.processes import run_cli

NOT_A_NAME = "is not a directory name; give a path that ends in one, e.g. --out data/mine"
BELOW_A_FILE = "is a file, not a directory; give an --out whose parents are directories"
UNWRITABLE = "give a directory you can write to"


def listing(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def prepare_cli(tmp_path, out):
    (tmp_path / "doc.txt").write_text("hello\n")
    return run_cli("prepare", tmp_path / "doc.txt", "--out", out, "--tokenizer", "byte")


@pytest.mark.parametrize("out, message", [
    ("{tmp}/f/d", "--out {tmp}/f/d: {tmp}/f " + BELOW_A_FILE),
    ("{tmp}/f/d/e", "--out {tmp}/f/d/e: {tmp}/f " + BELOW_A_FILE),
    ("{tmp}/f", "--out {tmp}/f is a file; give a directory"),
    ("{tmp}/new/..", "--out {tmp}/new/.. " + NOT_A_NAME),
    ("/", "--out / " + NOT_A_NAME),
], ids=["below-file", "deep-below-file", "is-file", "dotdot", "root"])
def test_out_below_a_file_or_without_a_name(tmp_path, out, message):
    (tmp_path / "f").write_text("a file")
    (tmp_path / "doc.txt").write_text("hello\n")
    before = listing(tmp_path)
    result = prepare_cli(tmp_path, out.format(tmp=tmp_path))
    assert result.returncode == 2
    assert result.stderr == f"ddpgpt: error: {message.format(tmp=tmp_path)}\n"
    assert listing(tmp_path) == before


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's /proc takes no new entry")
@pytest.mark.parametrize("out", ["/proc/ddpgpt-x", "/proc/ddpgpt-x/y/z"], ids=["in", "below"])
def test_out_in_an_unwritable_place(tmp_path, out):
    result = prepare_cli(tmp_path, out)
    assert result.returncode == 2
    assert result.stderr == (f"ddpgpt: error: --out {out}: cannot write in /proc (No such file or "
                             f"directory); {UNWRITABLE}\n")
    assert not os.path.exists("/proc/ddpgpt-x") and listing(tmp_path) == ["doc.txt"]


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_out_in_a_read_only_directory(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    try:
        result = prepare_cli(tmp_path, locked / "a" / "o")
        assert result.returncode == 2
        assert result.stderr == (f"ddpgpt: error: --out {locked}/a/o: cannot write in {locked} "
                                 f"(Permission denied); {UNWRITABLE}\n")
        assert list(locked.iterdir()) == []
    finally:
        locked.chmod(0o700)


def test_a_refused_partial_takes_the_new_parents_with_it(tmp_path, monkeypatch):
    """The parents are made, then the partial is refused (as a full or read-only disk would):
    the error names the place, and the parents made for the run are gone again."""
    mkdir = Path.mkdir

    def refuse_partials(path, *args, **kwargs):
        if path.name.endswith(".partial"):
            raise PermissionError(13, "Permission denied", str(path))
        return mkdir(path, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", refuse_partials)
    (tmp_path / "doc.txt").write_text("hello\n")
    out = tmp_path / "a" / "b" / "o"
    cfg = PrepareConfig(sources=[str(tmp_path / "doc.txt")], out=str(out), tokenizer="byte")
    with pytest.raises(UserError) as e:
        prepare.run(cfg)
    where = out.parent
    assert str(e.value) == f"--out {out}: cannot write in {where} (Permission denied); {UNWRITABLE}"
    assert listing(tmp_path) == ["doc.txt"]


def test_new_parents_go_with_a_failed_run_and_stay_with_a_finished_one(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    out = tmp_path / "a" / "b" / "o"
    result = run_cli("prepare", tmp_path / "empty.txt", "--out", out, "--tokenizer", "byte")
    assert result.returncode == 2 and result.stderr.startswith("ddpgpt: error: no documents in ")
    assert listing(tmp_path) == ["empty.txt"]
    (tmp_path / "d1.txt").write_text("one")
    (tmp_path / "d2.txt").write_text("two")
    result = run_cli("prepare", tmp_path / "d1.txt", tmp_path / "d2.txt", "--out", out,
                     "--tokenizer", "byte", "--val-fraction", "0.5")
    assert result.returncode == 0, result.stderr
    assert (out / "meta.json").is_file()

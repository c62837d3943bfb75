"""files.py: the one atomic write (its fsync policy, its failures), the one publication of a
directory, and the one message for an optional package that is not installed."""

import os
import sys
import threading

import pytest

from ddpgpt.errors import UserError
from ddpgpt.files import NotMovedAside, atomic_write, missing, publish_dir, require


def test_the_data_is_synced_before_the_rename_and_the_directory_after(tmp_path, monkeypatch):
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))))
        real_fsync(fd)

    def replace(a, b):
        events.append(("replace", os.path.basename(a), os.path.basename(b)))
        real_replace(a, b)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    path = tmp_path / "a.json"
    with atomic_write(path) as f:
        f.write(b"new")
    (sync_tmp, name), (kind, tmp, final), sync_dir = events
    assert sync_tmp == "fsync" and name == tmp and tmp.startswith(".a.json.tmp-")
    assert (kind, final) == ("replace", "a.json") and sync_dir == ("fsync", tmp_path.name)
    assert path.read_bytes() == b"new" and os.listdir(tmp_path) == ["a.json"]


def test_a_failed_write_keeps_the_old_file_and_leaves_nothing(tmp_path):
    path = tmp_path / "a.json"
    path.write_bytes(b"old")
    with pytest.raises(RuntimeError, match="mid-write"), atomic_write(path) as f:
        f.write(b"half")
        raise RuntimeError("mid-write")
    assert path.read_bytes() == b"old" and os.listdir(tmp_path) == ["a.json"]


def test_concurrent_writers_each_rename_a_whole_copy(tmp_path):
    path = tmp_path / "a.bin"

    def write(byte: bytes):
        for _ in range(20):
            with atomic_write(path) as f:
                for _ in range(64):
                    f.write(byte * 1024)

    threads = [threading.Thread(target=write, args=(b,)) for b in (b"a", b"b", b"c")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    data = path.read_bytes()
    assert len(data) == 64 * 1024 and data in (b"a" * len(data), b"b" * len(data),
                                               b"c" * len(data))
    assert os.listdir(tmp_path) == ["a.bin"]


def test_a_published_directory_replaces_the_old_one_or_leaves_it(tmp_path, monkeypatch):
    final, tmp = tmp_path / "out", tmp_path / ".out.partial"
    for d, text in ((final, "old"), (tmp, "new")):
        d.mkdir()
        (d / "f").write_text(text)
    real_rename = os.rename

    def refuse_aside(a, b):
        if os.path.basename(a) == "out":
            raise OSError(16, "Device or resource busy", a)
        real_rename(a, b)

    monkeypatch.setattr(os, "rename", refuse_aside)
    with pytest.raises(NotMovedAside, match="Device or resource busy"):
        publish_dir(tmp, final)
    assert (final / "f").read_text() == "old" and (tmp / "f").read_text() == "new"
    monkeypatch.setattr(os, "rename", real_rename)
    publish_dir(tmp, final)
    assert (final / "f").read_text() == "new" and os.listdir(tmp_path) == ["out"]


def test_a_missing_extra_is_one_line_in_one_format(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails as if not installed
    with pytest.raises(UserError) as e:
        require("matplotlib", "plot", "plot")
    assert str(e.value) == "plot needs matplotlib: pip install 'ddpgpt[plot]'"
    assert missing("pyarrow.parquet", "data", "a parquet source", " (or convert it)") == \
        "a parquet source needs pyarrow: pip install 'ddpgpt[data]' (or convert it)"
    assert require("json", "dev", "a test").dumps([1]) == "[1]"

"""`prepare --out URL`'s upload (data/prepare/upload.py) against a real S3 server (moto's,
tests/s3.py): an object is skipped only when it holds the staged file's bytes (its ETag, which
the server computes, equals the MD5 we compute), so a dataset replaced by one whose shard has the
same size but other bytes is uploaded whole and verified.json vouches for what is there."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from ddpgpt.data import storage, verify
from ddpgpt.data.prepare import upload
from ddpgpt.data.shards import HEADER_BYTES, TokenDataset
from ddpgpt.errors import UserError

MiB = 1 << 20


@pytest.fixture
def staged(tiny_data, tmp_path):
    """A finished staging directory: a copy of the tiny dataset."""
    out = tmp_path / "staged"
    shutil.copytree(tiny_data, out, ignore=shutil.ignore_patterns("verified.json"))
    return out


def uploads(monkeypatch) -> list[str]:
    """The names Objects.upload sends, from now on."""
    sent, real = [], storage.Objects.upload

    def noting(self, local, name):
        sent.append(name)
        return real(self, local, name)

    monkeypatch.setattr(storage.Objects, "upload", noting)
    return sent


def test_a_replaced_shard_of_the_same_size_is_uploaded_and_verified(s3, staged, monkeypatch):
    url = s3.bucket("same") + "/tiny"
    upload.publish(staged, url)
    meta = json.loads((staged / "meta.json").read_text())
    shard = meta["shards"]["train"][0]
    path = staged / shard["file"]
    data = bytearray(path.read_bytes())
    data[HEADER_BYTES] ^= 1  # the same size, another token
    path.write_bytes(bytes(data))
    shard["sha256"] = hashlib.sha256(data).hexdigest()
    (staged / "meta.json").write_text(json.dumps(meta))
    sent = uploads(monkeypatch)
    upload.publish(staged, url)  # --force over the old dataset, or a rerun after a change
    assert sent == [shard["file"], "meta.json"]  # what changed, and the marker
    fs = s3.fs()
    for local in staged.iterdir():
        if local.is_file() and local.name not in (upload.STAGED, "verified.json"):
            assert fs.cat_file(f"{url[5:]}/{local.name}") == local.read_bytes(), local.name
    ds = TokenDataset(url)
    assert verify.stale(ds) == []  # verified.json vouches for the objects as they are
    verify.hash_share(ds)  # and they hash to meta.json's sha256


def test_the_etag_of_an_upload_is_the_md5_computed_here(s3, tmp_path, monkeypatch):
    """The oracle is the server's ETag: of one PUT, and of a multipart upload (3 parts)."""
    monkeypatch.setattr(storage, "PART", 5 * MiB)  # S3's smallest part
    url = s3.bucket("etag") + "/x"
    objects = storage.Objects(url)
    for name, size in (("small", 1000), ("multi", 11 * MiB)):
        (tmp_path / name).write_bytes(bytes(range(256)) * (size // 256) + b"x" * (size % 256))
        objects.upload(tmp_path / name, name)
    there = objects.listing(fresh=True)
    assert there["multi"]["ETag"].strip('"').endswith("-3")
    for name in ("small", "multi"):
        assert storage.etag(tmp_path / name) == there[name]["ETag"].strip('"'), name
        assert storage.same(there[name], tmp_path / name)
    (tmp_path / "small").write_bytes(b"y" * 1000)
    assert not storage.same(there["small"], tmp_path / "small")  # same size, other bytes
    assert not storage.same({**there["small"], "ETag": '"abc"'}, tmp_path / "small")


def test_merge_downloads_a_part_again_when_its_objects_changed(s3, tmp_path, monkeypatch):
    """--merge with a part at a URL keeps its download in the staging directory: reused while
    the part's objects are the same (names, sizes, ETags), downloaded again once a prepare wrote
    the part again, even at the same size; the oracle is the bytes at the URL."""
    monkeypatch.setenv("DDPGPT_CACHE_DIR", str(tmp_path / "cache"))
    url, fs = s3.bucket("parts") + "/p/0", s3.fs()
    fs.pipe_file(f"{url[5:]}/train_000000.bin", b"a" * 100)
    fs.pipe_file(f"{url[5:]}/part.json", b'{"part": 0}')
    got, real = [], type(fs).get_file

    def noting(self, rpath, lpath, **kw):
        got.append(rpath.rsplit("/", 1)[-1])
        return real(self, rpath, lpath, **kw)

    monkeypatch.setattr(type(fs), "get_file", noting)
    (local,) = upload.fetch_parts([url])
    assert got == ["train_000000.bin", "part.json"]  # the marker last
    assert upload.fetch_parts([url]) == [local] and len(got) == 2  # unchanged: not again
    fs.pipe_file(f"{url[5:]}/train_000000.bin", b"b" * 100)  # prepared again: same size
    assert upload.fetch_parts([url]) == [local]
    assert got[2:] == ["train_000000.bin", "part.json"]
    assert (Path(local) / "train_000000.bin").read_bytes() == b"b" * 100


def test_an_upload_cut_short_is_no_dataset_and_the_same_upload_again_sends_the_rest(
        s3, staged, monkeypatch):
    """An upload killed after its first shard (Ctrl-C, as SIGKILL or the server gone would leave
    it) leaves no meta.json at the URL, so nothing reads it as a dataset; publishing the same
    staging again sends only what is missing, and the dataset then reads as the local one."""
    url = s3.bucket("cut") + "/tiny"
    real, calls = storage.Objects.upload, []

    def cut(self, local, name):
        if calls:
            raise KeyboardInterrupt
        calls.append(name)
        return real(self, local, name)

    monkeypatch.setattr(storage.Objects, "upload", cut)
    with pytest.raises(KeyboardInterrupt):
        upload.publish(staged, url)
    there = storage.Objects(url).listing(fresh=True)
    assert list(there) == calls and "meta.json" not in there
    with pytest.raises(UserError, match="meta.json"):
        TokenDataset(url)
    monkeypatch.setattr(storage.Objects, "upload", real)
    sent = uploads(monkeypatch)
    upload.publish(staged, url)
    assert calls[0] not in sent and sent[-1] == "meta.json"  # the first shard is not sent again
    local, remote = TokenDataset(staged), TokenDataset(url)
    for split in local.meta["shards"]:
        for a, b in zip(local.meta["shards"][split], remote.meta["shards"][split], strict=True):
            assert a == b
    verify.hash_share(remote)  # the objects hash to meta.json's sha256

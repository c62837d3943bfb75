"""The shards' hashes of a dataset in a bucket this job may only read (data/verify.py), against a
real S3 server that enforces a reader-only user's policy (moto's with IAM, tests/s3.py): the
first start hashes every shard and keeps the entries on this machine, since verified.json
cannot be written there; the second start hashes nothing; a shard rewritten at the URL (another
ETag) is hashed again. Counted in bytes hashed, the oracle being the objects' sizes."""

from __future__ import annotations

import pytest

from ddpgpt.data import storage, verify
from ddpgpt.data.shards import HEADER_BYTES, TokenDataset
from tests.s3 import S3Server


@pytest.fixture(scope="module")
def read_only(tmp_path_factory, tiny_data):
    """A server with a writer and a reader-only user; the tiny dataset uploaded by the writer,
    without verified.json (a dataset others prepared)."""
    server = S3Server.start(tmp_path_factory.mktemp("readonly"), auth=True)
    try:
        fs = server.fs(server.writer)
        url = server.bucket("guarded") + "/tiny"
        for name in ("train_000000.bin", "val_000000.bin", "meta.json"):
            fs.put_file(str(tiny_data / name), f"{url[5:]}/{name}")
        yield server, url
    finally:
        server.stop()


def start(url) -> int:
    """One training start's verification at W=1 (run/verify.py's steps): bytes hashed."""
    ds = TokenDataset(url)
    entries = verify.hash_share(ds)
    verify.record(ds.files, entries, quiet=True)
    return sum(ds.files.size(name) for name in entries)


@pytest.fixture
def hashed(monkeypatch):
    """Bytes read to hash objects, from now on."""
    counted, real = [], storage.hash_object

    def counting(fs, key, size, url, kind=storage.DataError):
        counted.append(size)
        return real(fs, key, size, url, kind)

    monkeypatch.setattr(storage, "hash_object", counting)
    return counted


@pytest.fixture
def reader(read_only, tmp_path, monkeypatch):
    """This process as the reader-only user, with its own DDPGPT_CACHE_DIR."""
    import s3fs

    server, url = read_only
    monkeypatch.setenv("DDPGPT_CACHE_DIR", str(tmp_path / "cache"))
    for key, value in server.env(server.reader).items():
        monkeypatch.setenv(key, value)
    s3fs.S3FileSystem.clear_instance_cache()
    yield server, url
    s3fs.S3FileSystem.clear_instance_cache()


def test_a_read_only_bucket_is_hashed_once_per_machine(reader, hashed):
    server, url = reader
    with pytest.raises(storage.DataError, match="writing"):  # the oracle: it is read-only
        storage.Objects(url).write("probe", b"")
    every = sum(storage.Objects(url).size(n) for n in ("train_000000.bin", "val_000000.bin"))
    assert start(url) == every and sum(hashed) == every
    assert not storage.Objects(url).has(verify.CACHE)  # nothing written at the URL
    assert start(url) == 0 and sum(hashed) == every  # the second start: nothing hashed

    writer, key = server.fs(server.writer), f"{url[5:]}/val_000000.bin"
    data = bytearray(writer.cat_file(key))
    data[HEADER_BYTES] ^= 1  # rewritten at the URL: the same size, another ETag
    writer.pipe_file(key, bytes(data))
    with pytest.raises(storage.DataError, match="val_000000.bin: sha256 mismatch"):
        start(url)
    assert sum(hashed) == every + len(data)


"""The shards' hashes of a dataset in a bucket this job may only read (data/verify.py), against a
real S3 server that enforces a reader-only user's policy (moto's with IAM, tests/s3.py): the
first start hashes every shard and keeps the entries on this machine, since verified.json
cannot be written there; the second start hashes nothing; a shard rewritten at the URL (another
ETag) is hashed again. Its packing (data.align bos) is made by one of a node's ranks, which
reads the split once, and read by the others; a second start reads no token for it. Counted in
bytes hashed and read, the oracle being the objects' sizes and the local dataset's packing."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from ddpgpt.data import packing, storage, verify
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


def test_a_read_only_buckets_packing_is_read_once_per_node(reader, tiny_data, monkeypatch):
    """Four ranks of one node open the bos packing of the train split at once: one of them reads
    the split's tokens, once; a second start reads none; the rows are the local dataset's."""
    _, url = reader
    got, real = [], storage.Objects.ranges

    def counting(self, requests):
        data = real(self, requests)  # tokens: what lies past a shard's header
        got.append(sum(len(d) for (_, start, _), d in zip(requests, data)
                       if start >= HEADER_BYTES))
        return data

    monkeypatch.setattr(storage.Objects, "ranges", counting)
    T, rows, errors = 31, {}, []

    def rank(r):
        try:
            rows[r] = packing.row_source(TokenDataset(url), "train", T, "bos")
        except BaseException as e:  # reported below
            errors.append(e)

    ranks = [threading.Thread(target=rank, args=(r,)) for r in range(4)]
    for t in ranks:
        t.start()
    for t in ranks:
        t.join(120)
    assert not errors and len(rows) == 4, errors
    split = rows[0].stream.num_tokens * rows[0].stream.dtype.itemsize
    assert sum(got) == split  # the split read once by the node's four ranks, not four times
    assert not storage.Objects(url).has(f"packing-train-{T + 1}.npz")  # nothing at the URL
    again = packing.row_source(TokenDataset(url), "train", T, "bos")
    assert sum(got) == split  # the next start: no token read to pack
    local = packing.row_source(TokenDataset(tiny_data), "train", T, "bos")
    for made in (*rows.values(), again):
        for name in ("piece_start", "piece_len", "row_ptr"):
            np.testing.assert_array_equal(getattr(made, name), getattr(local, name))

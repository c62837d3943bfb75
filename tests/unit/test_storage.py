"""Datasets in object storage (data/storage.py) against a real S3 server (moto's, tests/s3.py):
the same batches as the local copy at W=1 and 2, each rank fetching exactly its own windows'
bytes; the cache; the next step fetched while this one computes; identity from size and ETag;
bad prefixes and buckets as one line."""

from __future__ import annotations

import os
import shutil
import threading

import numpy as np
import pytest

from ddpgpt.config.schema import DataConfig
from ddpgpt.data import storage, verify
from ddpgpt.data.fetch import MIN_AHEAD
from ddpgpt.data.loader import EvalLoader, TrainLoader
from ddpgpt.data.mixture import MixedDataset, MixtureLoader
from ddpgpt.data.shards import HEADER_BYTES, TokenDataset
from ddpgpt.errors import DataError
from tests.helpers import write_dataset

T, B = 32, 2


def loaders(ds, world, rank, **kw):
    return TrainLoader(ds, seq_len=T, micro_batch=B, world_size=world, rank=rank,
                       accum_steps=4 // world, **kw)


def settle(loader) -> None:
    """Waits for the fetches ahead that the loader started."""
    for future in list(loader.stream.reader._pending.values()):
        future.result()


def test_a_dataset_in_s3_opens_as_its_local_copy(s3_data, tiny_data):
    remote, local = TokenDataset(s3_data), TokenDataset(tiny_data)
    assert remote.fingerprint == local.fingerprint and remote.path == s3_data
    for split in ("train", "val"):
        assert [np.array_equal(a, b) for a, b in zip(remote.tokens(split), local.tokens(split))] \
            == [True] * len(local.tokens(split))


@pytest.mark.parametrize("world", [1, 2])
def test_each_rank_reads_the_local_batches_and_only_its_own_windows(s3_data, tiny_data, world):
    remote, local = TokenDataset(s3_data), TokenDataset(tiny_data)
    for rank in range(world):
        a, b = loaders(remote, world, rank), loaders(local, world, rank)
        windows = []
        for _ in range(3):
            step = a.order(a.epoch).items(a.consumed, a.consumed + a.global_batch)
            windows += list(a.mine(step))
            for (x1, y1), (x2, y2) in zip(a.next_step(), b.next_step()):
                assert np.array_equal(x1, x2) and np.array_equal(y1, y2)
        settle(a)
        # its windows of 3 steps and of the steps after them that it named to the reader
        # (fetch.ahead_steps: at least the next one), nothing else
        assert a.fetched_until >= 4
        for index in range(3, a.fetched_until):
            start = index * a.global_batch
            windows += list(a.mine(a.order(a.epoch).items(start, start + a.global_batch)))
        expected = len(windows) * (T + 1) * remote.dtype.itemsize
        assert a.stream.reader.fetched_bytes == expected


def test_rows_packed_from_documents_and_evaluation_are_the_local_ones(s3_data, tiny_data):
    remote, local = TokenDataset(s3_data), TokenDataset(tiny_data)
    a, b = loaders(remote, 2, 1, align="bos"), loaders(local, 2, 1, align="bos")
    for (x1, _), (x2, _) in zip(a.next_step(), b.next_step()):
        assert np.array_equal(x1, x2)
    va = EvalLoader(remote, seq_len=T, micro_batch=B, world_size=2, rank=1, max_windows=9)
    vb = EvalLoader(local, seq_len=T, micro_batch=B, world_size=2, rank=1, max_windows=9)
    for (x1, y1), (x2, y2) in zip(va, vb):
        assert np.array_equal(x1, x2) and np.array_equal(y1, y2)


def test_a_mixture_of_a_url_and_a_directory(s3_data, tiny_data, tmp_path):
    """The URL's dataset and another, against the same mixture of its local copy: the same
    rows. (The same data under a URL and a path in one mixture is refused: data/mixture.py.)"""
    rng = np.random.default_rng(0)
    other = write_dataset(tmp_path / "tiny", rng.integers(0, 256, 3000),
                          rng.integers(0, 256, 600), vocab_size=257, eot_id=256)
    sources = DataConfig(dir=f"{s3_data}:0.7,{other}:0.3").sources()
    assert sources == [(s3_data, 0.7), (str(other), 0.3)]
    assert DataConfig(dir=f"{s3_data},{other}").sources()[0] == (s3_data, 0.5)
    mixed = MixedDataset(sources)
    assert mixed.names == [f"{s3_data.split('/')[2]}-tiny", f"{other.parent.name}-tiny"]
    with pytest.raises(DataError, match="are the same data"):
        MixedDataset([(s3_data, 0.5), (str(tiny_data), 0.5)])
    local = MixedDataset([(str(tiny_data), 0.7), (str(other), 0.3)])
    a = MixtureLoader(mixed, seq_len=T, micro_batch=B, world_size=2, rank=0, accum_steps=2)
    b = MixtureLoader(local, seq_len=T, micro_batch=B, world_size=2, rank=0, accum_steps=2)
    for _ in range(2):
        for (x1, _), (x2, _) in zip(a.next_step(), b.next_step()):
            assert np.array_equal(x1, x2)


def test_the_cache_keeps_what_was_read(s3_data, tmp_path):
    ds = TokenDataset(s3_data)
    first = loaders(ds, 2, 0, cache=str(tmp_path))
    batches = [[x.clone() for x, _ in first.next_step()] for _ in range(2)]
    settle(first)
    assert first.stream.reader.fetched_bytes > 0
    assert sorted(p.name for p in tmp_path.glob("*/*"))  # blocks, written whole
    again = loaders(ds, 2, 0, cache=str(tmp_path))  # a restart on this node
    assert [[x for x, _ in again.next_step()] for _ in range(2)][0][0].equal(batches[0][0])
    settle(again)
    assert again.stream.reader.fetched_bytes == 0  # all from the local disk


def test_a_dataset_replaced_at_its_url_is_never_read_from_the_cache(s3, tiny_data, tmp_path):
    """--data.cache keeps blocks under the objects' identities (size and ETag): a dataset
    prepared again at the same URL (shards of the same size, other tokens) is fetched anew at
    the next start, whose batches are the new dataset's, not the cache's old bytes."""
    url, fs = s3.bucket("replaced") + "/tiny", s3.fs()
    other = write_dataset(tmp_path / "other", (np.arange(50788) * 7) % 257,
                          (np.arange(28401) * 3) % 257, vocab_size=257, eot_id=256)
    for source in (tiny_data, other):
        for path in sorted(source.iterdir(), key=lambda p: p.name == "meta.json"):
            if path.name in ("train_000000.bin", "val_000000.bin", "meta.json"):
                fs.put_file(str(path), f"{url[5:]}/{path.name}")
        remote, local = loaders(TokenDataset(url), 1, 0, cache=str(tmp_path / "cache")), \
            loaders(TokenDataset(source), 1, 0)
        for _ in range(2):
            for (x1, y1), (x2, y2) in zip(remote.next_step(), local.next_step()):
                assert np.array_equal(x1, x2) and np.array_equal(y1, y2)
        settle(remote)
        assert remote.stream.reader.fetched_bytes > 0  # the new objects: not from the cache


def test_the_next_step_is_fetched_while_this_one_computes(s3_data, monkeypatch):
    """Counted, not timed: the first step's windows are fetched in one concurrent batch (not one
    request after another); while it computes, the next step's are fetched in the background,
    so that step makes no request of its own; and so on for the steps named after."""
    real, calls = storage.Objects.ranges, []

    def noting(self, requests):
        calls.append((threading.current_thread() is threading.main_thread(), len(requests)))
        return real(self, requests)

    monkeypatch.setattr(storage.Objects, "ranges", noting)
    loader = loaders(TokenDataset(s3_data), 1, 0)
    per_step = len(set(loader.mine(loader.order(loader.epoch).items(0, loader.global_batch))))
    calls.clear()  # (opening the dataset read the shards' headers)
    list(loader.next_step())
    assert calls[0][1] == per_step, calls  # the first step: its windows in one batch
    settle(loader)  # the step's forward and backward: the fetch ahead has finished meanwhile
    first = len(calls)  # the next steps' (fetch.MIN_AHEAD - 1 of them: nothing timed yet)
    assert first == MIN_AHEAD and calls[1:] == [(False, per_step)] * (first - 1), calls
    list(loader.next_step())
    settle(loader)
    # the steps after it that the loader named (as many as a fetch takes in step times: up to
    # fetch.MAX_AHEAD here, where steps take no time), each in one batch behind, none in front
    assert loader.fetched_until > MIN_AHEAD
    assert calls[first:] == [(False, per_step)] * (loader.fetched_until - first), calls


def test_an_object_rewritten_is_hashed_again_and_its_change_is_one_line(s3, tiny_data):
    url = s3.bucket("rewrite") + "/tiny"
    fs = s3.fs()
    for path in sorted(tiny_data.iterdir(), key=lambda p: p.name == "meta.json"):
        if path.is_file() and path.name != "verified.json":
            fs.put_file(str(path), f"{url[5:]}/{path.name}")
    ds = TokenDataset(url)
    assert len(verify.stale(ds)) == 2  # no cache yet: both shards hashed on first use
    assert verify.record(ds.files, verify.hash_share(ds))
    assert verify.stale(TokenDataset(url)) == []  # the next start: none
    name = ds.shards["train"][0].file
    data = bytearray(fs.cat_file(f"{url[5:]}/{name}"))
    data[HEADER_BYTES] ^= 1  # same size, another byte: another ETag
    fs.pipe_file(f"{url[5:]}/{name}", bytes(data))
    again = TokenDataset(url)
    assert [i.file for i in verify.stale(again)] == [name]
    with pytest.raises(DataError, match=rf"^{url}/{name}: sha256 mismatch \(file "):
        verify.hash_share(again)


def test_a_file_url_has_the_identity_of_its_local_file(tiny_data, tmp_path):
    """A dataset named by a file:// URL (fsspec's local files: no ETag) is checked by its files'
    size, times and inode, as at its path: a shard rewritten in place, same size, is hashed
    again and its change is one line."""
    local = tmp_path / "tiny"
    shutil.copytree(tiny_data, local, ignore=shutil.ignore_patterns("verified.json"))
    url = f"file://{local}"
    ds = TokenDataset(url)
    name = ds.shards["train"][0].file
    assert ds.files.identity(name) == storage.Directory(local).identity(name)
    assert verify.record(ds.files, verify.hash_share(ds)) and verify.stale(TokenDataset(url)) == []
    data = bytearray((local / name).read_bytes())
    data[HEADER_BYTES] ^= 1
    with open(local / name, "r+b") as f:  # in place: the same inode and size
        f.write(bytes(data))
    again = TokenDataset(url)
    assert [i.file for i in verify.stale(again)] == [name]
    with pytest.raises(DataError, match=rf"^{url}/{name}: sha256 mismatch \(file "):
        verify.hash_share(again)


def test_a_prefix_without_meta_json_and_an_unknown_bucket_are_one_line(s3):
    url = s3.bucket("partial") + "/half"
    s3.fs().pipe_file(f"{url[5:]}/train_000000.bin", b"x")
    with pytest.raises(DataError, match=rf"^dataset {url} has no meta.json \(not prepared, or "
                                        rf"prepare did not finish\); re-run ddpgpt prepare --out "
                                        rf"{url}$"):
        TokenDataset(url)
    with pytest.raises(DataError, match=rf"^dataset {url}-not does not exist; create it with: "):
        TokenDataset(url + "-not")
    with pytest.raises(DataError, match=rf"^dataset {url}/train_000000.bin does not exist \(did "
                                        rf"you mean {url}\? it names an object\); create it "):
        TokenDataset(f"{url}/train_000000.bin")  # an object: not a prefix with itself in it
    with pytest.raises(DataError, match=r"^listing s3://no-such-bucket/x: the bucket "
                                        r"no-such-bucket does not exist at the S3 endpoint "
                                        r"http://127.0.0.1:\d+; "
                                        r"create it, or fix the URL \(or AWS_ENDPOINT_URL\)$"):
        TokenDataset("s3://no-such-bucket/x")


@pytest.mark.parametrize("error", [FileNotFoundError("The specified bucket does not exist"),
                                   PermissionError("Forbidden"), ConnectionError("refused"),
                                   type("NoCredentialsError", (Exception,), {})("none")])
def test_a_failure_names_the_storage_the_url_went_to(error, monkeypatch):
    """Every one-line failure at an s3:// URL names the S3 endpoint it went to (MinIO, Ceph ...:
    AWS_ENDPOINT_URL), or AWS S3 when none is set; at a gs:// URL, GCS and its own
    credentials, never AWS's."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://minio.local:9000")
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    line = storage.explain(error, "s3://b/x", "listing")
    assert line.startswith("listing s3://b/x: ")
    assert "the S3 endpoint http://minio.local:9000" in line, line
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    assert "AWS S3 (AWS_ENDPOINT_URL unset)" in storage.explain(error, "s3://b/x", "listing")
    line = storage.explain(error, "gs://b/x", "listing")
    assert "GCS" in line and "AWS" not in line and "aws" not in line, line


def test_requests_orphaned_by_a_cut_transfer_are_not_printed_as_tracebacks(caplog):
    """A transfer cut mid-batch leaves the batch's other requests failing unawaited; asyncio
    printed each with a traceback after the one-line error (seen on an upload cut by the server
    going away). Those are dropped on fsspec's loop; any other loop error still reaches asyncio's
    log."""
    import asyncio

    storage.filesystem("s3://some-bucket/prefix")  # makes no request
    import fsspec.asyn
    loop = fsspec.asyn.get_loop()
    handler = loop.get_exception_handler()
    orphan = "Task exception was never retrieved"
    with caplog.at_level("ERROR", logger="asyncio"):
        handler(loop, {"message": orphan, "exception": ConnectionResetError("closing transport")})
        assert caplog.records == []
        handler(loop, {"message": orphan, "exception": ValueError("a bug")})
        handler(loop, {"message": "something else", "exception": ConnectionResetError("x")})
    assert [r.getMessage().split("\n")[0] for r in caplog.records] == [orphan, "something else"]
    assert all(r.name == asyncio.log.logger.name for r in caplog.records)


def test_the_servers_variables_are_only_for_the_tests_that_ask_for_them(s3_server):
    """The tests above had the server's variables (the `s3` fixture); this one, after them, asks
    for the server alone: nothing in its environment points at it."""
    assert os.environ.get("AWS_ENDPOINT_URL") != s3_server.endpoint

"""Shard files and dataset directories: round trip and every validation error, word for word."""

import json

import numpy as np
import pytest

from ddpgpt.data.shards import HEADER_BYTES, ShardWriter, TokenDataset, open_shard, read_header
from ddpgpt.errors import DataError
from tests.helpers import json_error, write_dataset

REPREPARE = "re-run ddpgpt prepare"


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_round_trip(tmp_path, dtype):
    tokens = np.random.default_rng(0).integers(0, np.iinfo(dtype).max, 10_000, dtype=np.int64)
    writer = ShardWriter(tmp_path / "s.bin", dtype)
    writer.write(tokens[:3000])
    writer.write(tokens[3000:])
    info = writer.close()
    assert info.tokens == 10_000
    assert (tmp_path / "s.bin").stat().st_size == HEADER_BYTES + 10_000 * np.dtype(dtype).itemsize
    back = open_shard(tmp_path / "s.bin")
    assert back.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(back, tokens)


def test_dataset_splits_into_shards(tmp_path):
    train, val = np.arange(2500) % 300, np.arange(700) % 300
    ds = TokenDataset(write_dataset(tmp_path / "d", train, val, vocab_size=300, shard_tokens=1000))
    assert [s.file for s in ds.shards["train"]] == ["train_000000.bin", "train_000001.bin",
                                                    "train_000002.bin"]
    assert [len(t) for t in ds.tokens("train")] == [1000, 1000, 500]
    np.testing.assert_array_equal(np.concatenate(ds.tokens("train")), train)
    np.testing.assert_array_equal(np.concatenate(ds.tokens("val")), val)
    assert ds.verify() == 4


@pytest.fixture
def dataset(tmp_path):
    return write_dataset(tmp_path / "d", np.arange(1000) % 500, np.arange(200) % 500,
                         vocab_size=500)


def _error(path):
    with pytest.raises(DataError) as e:
        TokenDataset(path)
    return str(e.value)


def test_bad_magic(dataset):
    shard = dataset / "train_000000.bin"
    data = bytearray(shard.read_bytes())
    data[:8] = b"NOTMAGIC"
    shard.write_bytes(bytes(data))
    assert _error(dataset) == f"{shard}: not a ddpgpt shard (bad magic b'NOTMAGIC'); {REPREPARE}"


def test_truncated(dataset):
    shard = dataset / "train_000000.bin"
    data = shard.read_bytes()
    shard.write_bytes(data[:-10])
    assert _error(dataset) == (
        f"{shard}: truncated: header says 1000 uint16 tokens (3024 bytes) but the file has 3014 "
        f"bytes; {REPREPARE}"
    )


def test_shorter_than_header(dataset):
    shard = dataset / "val_000000.bin"
    shard.write_bytes(b"DDPG")
    assert _error(dataset) == (f"{shard}: truncated shard (4 bytes, shorter than its header); "
                               f"{REPREPARE}")


def test_wrong_dtype(dataset):
    meta = json.loads((dataset / "meta.json").read_text())
    meta["dtype"] = "uint32"
    (dataset / "meta.json").write_text(json.dumps(meta))
    shard = dataset / "train_000000.bin"
    assert _error(dataset) == f"{shard}: header dtype uint16 but meta.json says uint32; {REPREPARE}"


def test_unknown_dtype_code(dataset):
    shard = dataset / "train_000000.bin"
    data = bytearray(shard.read_bytes())
    data[12] = 7
    shard.write_bytes(bytes(data))
    assert _error(dataset) == f"{shard}: unknown token dtype code 7 in header; {REPREPARE}"


def test_count_differs_from_meta(dataset):
    meta = json.loads((dataset / "meta.json").read_text())
    meta["shards"]["train"][0]["tokens"] = 999
    (dataset / "meta.json").write_text(json.dumps(meta))
    shard = dataset / "train_000000.bin"
    assert _error(dataset) == f"{shard}: holds 1000 tokens but meta.json says 999; {REPREPARE}"


def test_missing_shard(dataset):
    (dataset / "val_000000.bin").unlink()
    assert _error(dataset) == (f"{dataset / 'meta.json'} lists val_000000.bin but the file is "
                               f"missing; {REPREPARE}")


def test_checksum_mismatch(dataset):
    shard = dataset / "train_000000.bin"
    data = bytearray(shard.read_bytes())
    data[HEADER_BYTES + 5] ^= 1  # one flipped bit in the payload: header and size still valid
    shard.write_bytes(bytes(data))
    ds = TokenDataset(dataset)
    meta = json.loads((dataset / "meta.json").read_text())["shards"]["train"][0]["sha256"]
    with pytest.raises(DataError) as e:
        ds.verify()
    import hashlib
    actual = hashlib.sha256(bytes(data)).hexdigest()
    assert str(e.value) == (
        f"{shard}: sha256 mismatch (file {actual[:16]}, meta.json {meta[:16]}): "
        f"the shard changed after prepare; {REPREPARE}"
    )


def test_newer_shard_version(dataset):
    shard = dataset / "train_000000.bin"
    data = bytearray(shard.read_bytes())
    data[8] = 9
    shard.write_bytes(bytes(data))
    with pytest.raises(DataError, match="shard format version 9 is newer than this ddpgpt reads"):
        read_header(shard)


def test_missing_dataset(tmp_path):
    missing = tmp_path / "nope"
    assert _error(missing) == (f"dataset {missing} does not exist; create it with: "
                               f"ddpgpt prepare --out {missing}")


def test_corrupt_meta(dataset):
    text = '{"format_version": 1, "tok'
    (dataset / "meta.json").write_text(text)
    assert _error(dataset) == (f"{dataset / 'meta.json'}: corrupt or incomplete meta.json "
                               f"({json_error(text)}); {REPREPARE}")

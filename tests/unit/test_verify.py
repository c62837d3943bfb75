"""The shards' hashes at a training start (data/verify.py): checked once per file identity and
remembered in verified.json, so that a start costs the same whatever the dataset's size; every
shard still checked by exactly one rank; a changed shard still one line."""

import errno
import os

import pytest

from ddpgpt.config.commands import PrepareConfig
from ddpgpt.data import storage, verify
from ddpgpt.data.prepare import main as prepare
from ddpgpt.data.shards import TokenDataset
from ddpgpt.errors import DataError


@pytest.fixture
def data(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(6):
        (src / f"{i}.txt").write_text(f"document {i} " * 50)
    out = tmp_path / "data"
    prepare.run(PrepareConfig(sources=[str(src)], out=str(out), tokenizer="byte",
                              val_fraction=0.3, shard_tokens=500, workers=1))
    return out


@pytest.fixture
def hashed(monkeypatch):
    """The files the verifier hashes, in order."""
    seen = []
    real = storage.sha256  # what a local directory's files are hashed with

    def counting(path):
        seen.append(os.path.basename(path))
        return real(path)

    monkeypatch.setattr(storage, "sha256", counting)
    return seen


def shard_names(ds):
    return [i.file for infos in ds.shards.values() for i in infos]


def test_prepare_records_its_shards_so_a_start_hashes_none(data, hashed):
    ds = TokenDataset(data)
    assert len(shard_names(ds)) > 4
    assert sorted(verify.read_cache(data)) == sorted(shard_names(ds))
    assert verify.hash_share(ds) == {} and hashed == []


def test_a_dataset_without_the_cache_is_hashed_once_each_shard_by_one_rank(data, hashed):
    """A dataset prepared before the cache (or copied: new inodes): the first start hashes every
    shard, each by exactly one of W ranks; the next start hashes none."""
    (data / verify.CACHE).unlink()
    ds = TokenDataset(data)
    shares = [verify.hash_share(ds, rank, 3) for rank in range(3)]
    assert sorted(hashed) == sorted(shard_names(ds))  # each once, in all
    assert sum(len(s) for s in shares) == len(shard_names(ds))
    for share in shares:
        verify.record(data, share)
    hashed.clear()
    assert verify.hash_share(TokenDataset(data)) == {} and hashed == []


def test_a_shard_rewritten_is_hashed_again_and_a_changed_one_is_one_line(data, hashed):
    ds = TokenDataset(data)
    name = shard_names(ds)[1]
    path = data / name
    os.utime(path, ns=(0, 1_000_000_000))  # the same bytes, another time: hashed, and fine
    assert list(verify.hash_share(ds)) == [name] and hashed == [name]
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 1  # the same size, another byte, a new time
    path.write_bytes(bytes(raw))
    with pytest.raises(DataError, match=f"^{path}: sha256 mismatch .*the shard changed after "
                                        "prepare; re-run ddpgpt prepare$"):
        verify.hash_share(TokenDataset(data))


def test_prepare_verify_rehashes_every_shard_whatever_the_cache_says(data, hashed, capsys):
    """What the cache cannot see (a change that keeps size, time and inode: bit rot) is what
    `prepare --verify` is for."""
    ds = TokenDataset(data)
    path = data / shard_names(ds)[0]
    stat = path.stat()
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 1
    with open(path, "r+b") as f:  # in place: the same inode and size
        f.write(bytes(raw))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # and the same time
    assert verify.hash_share(TokenDataset(data)) == {}  # the cache vouches for it
    with pytest.raises(DataError, match="sha256 mismatch"):
        prepare.run(PrepareConfig(verify=str(data)))


def test_a_directory_that_cannot_be_written_keeps_no_cache(data, monkeypatch, capsys):
    (data / verify.CACHE).unlink()
    ds = TokenDataset(data)

    def refuse(self, name, data):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(storage.Directory, "write", refuse)
    assert not verify.record(data, verify.hash_share(ds))
    assert capsys.readouterr().err == (
        f"ddpgpt: warning: cannot write {data / verify.CACHE}: Read-only file system (EROFS): the "
        "shards' hashes are not remembered, so every start re-hashes them (--data.verify false "
        "skips that)\n")

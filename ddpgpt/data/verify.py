"""A dataset's shards checked against meta.json at every training start, at a cost that does not
grow with the dataset once its files are known.

Every start, every rank: each shard's header and size against meta.json (shards.TokenDataset
does it when it opens the dataset: a truncated, replaced or foreign file is one line). The
sha256 of a shard's bytes is checked once per file identity — (size, mtime_ns, inode): a file
rewritten or copied has a new one — and remembered in `verified.json` in the dataset directory:

    {"version": 1, "files": {"train_000000.bin": {"identity": [size, mtime_ns, inode],
                                                  "sha256": "..."}, ...}}

In object storage the identity is [size, ETag or version id] (storage.Objects.identity) and
the cache is one object beside the shards; `prepare --out URL` writes it after the upload.

`prepare` writes it for the shards it has just written and hashed; a start that finds a shard
with no entry, another identity or another sha256 than meta.json's hashes it (the ranks split the
work), and the entries are added. What the cache cannot see is a change that keeps the size,
time and inode (bit rot, an edit that restores the time): `ddpgpt prepare --verify DIR`
re-hashes every shard whatever the cache says (and refreshes it); deleting verified.json makes
the next start do the same. A dataset directory that cannot be written keeps no cache: its starts
hash every shard, as before (a warning says so, once per start).
"""

from __future__ import annotations

import json
import os

from ddpgpt.data import storage
from ddpgpt.data.shards import REPREPARE, ShardInfo, TokenDataset
from ddpgpt.errors import DataError, UserError, warn
from ddpgpt.files import WriteError, describe

CACHE = "verified.json"
CACHE_VERSION = 1


def _files(where) -> storage.Directory | storage.Objects:
    """A dataset's files: `where` itself, or the directory or URL it names."""
    return where if hasattr(where, "identity") else storage.open_dir(where)


def identity(path: os.PathLike) -> list[int]:
    st = os.stat(path)
    return [st.st_size, st.st_mtime_ns, st.st_ino]


def read_cache(directory) -> dict[str, dict]:
    """The cache's entries by file name; none when it is missing or unreadable."""
    files = _files(directory)
    try:
        cache = json.loads(files.read(CACHE))
        if int(cache["version"]) != CACHE_VERSION:
            return {}
        return {str(k): dict(v) for k, v in cache["files"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError, UserError):
        return {}


def stale(dataset: TokenDataset) -> list[ShardInfo]:
    """The shards whose bytes this cache does not vouch for: no entry, another identity, or
    another sha256 than meta.json lists."""
    files = dataset.files
    cache = read_cache(files) if files.has(CACHE) else {}
    out = []
    for info in (i for infos in dataset.shards.values() for i in infos):
        entry = cache.get(info.file)
        if entry is None or entry.get("sha256") != info.sha256 or \
                entry.get("identity") != files.identity(info.file):
            out.append(info)
    return out


def hash_share(dataset: TokenDataset, part: int = 0, parts: int = 1,
               every: bool = False) -> dict[str, dict]:
    """Checks the sha256 of the shards of every `parts`-th one from `part` (a fixed share, so
    that ranks whose views of the cache differ still check every shard) that the cache does not
    vouch for (`every`: all of them) against meta.json; returns their cache entries. A mismatch
    is one line naming the shard."""
    files = dataset.files
    shards = [i for infos in dataset.shards.values() for i in infos][part::parts]
    todo = shards if every else [i for i in stale(dataset) if i in shards]
    entries = {}
    for info in todo:
        before = files.identity(info.file)
        actual = files.sha256(info.file)
        if actual != info.sha256:
            raise DataError(f"{files.where(info.file)}: sha256 mismatch (file {actual[:16]}, "
                            f"meta.json {info.sha256[:16]}): the shard changed after prepare; "
                            f"{REPREPARE}")
        entries[info.file] = {"identity": before, "sha256": actual}
    return entries


def check_all(dataset: TokenDataset) -> int:
    """`prepare --verify`: every shard re-hashed whatever the cache says, and the cache
    refreshed. Returns the number of shards."""
    entries = hash_share(dataset, every=True)
    record(dataset.files, entries, quiet=True)
    return len(entries)


def record(directory, entries: dict[str, dict], quiet: bool = False) -> bool:
    """Adds `entries` to the cache (atomically: one object in object storage). False, with a
    warning unless `quiet`, when the dataset cannot be written."""
    if not entries:
        return True
    files = _files(directory)
    cached = read_cache(files)
    cached.update(entries)
    data = (json.dumps({"version": CACHE_VERSION, "files": cached}, indent=0) + "\n").encode()
    try:
        try:
            files.write(CACHE, data)
        except OSError as e:
            raise WriteError(f"cannot write {files.where(CACHE)}: {describe(e)}") from None
    except UserError as e:
        if not quiet:
            warn(f"{e}: the shards' hashes are not remembered, so every start re-hashes them "
                 "(--data.verify false skips that)")
        return False
    return True


def record_shards(directory, shards: dict[str, list[ShardInfo]]) -> None:
    """prepare: the shards it has just written and hashed (ShardWriter.close read them back),
    under their identity where they are now (a local directory, or the objects uploaded)."""
    files = _files(directory)
    record(files, {i.file: {"identity": files.identity(i.file), "sha256": i.sha256}
                   for infos in shards.values() for i in infos}, quiet=True)

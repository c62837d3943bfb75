"""A dataset's shards checked against meta.json at every training start, at a cost that does not
grow with the dataset once its files are known.

Every start, every rank: each shard's header and size against meta.json (shards.TokenDataset
does it when it opens the dataset: a truncated, replaced or foreign file is one line). The
sha256 of a shard's bytes is checked once per file identity — (size, mtime_ns, ctime_ns,
inode), storage.Directory.identity: a file rewritten or copied has a new one, and so has one
rewritten in place whose modification time was set back (`touch -d`, `os.utime`), since the
change time is the kernel's and no call sets it — and remembered in `verified.json` in the
dataset directory:

    {"version": 2, "files": {"train_000000.bin": {"identity": [size, mtime_ns, ctime_ns, inode],
                                                  "sha256": "..."}, ...}}

In object storage the identity is [size, ETag or version id] (storage.Objects.identity) and
the cache is one object beside the shards; `prepare --out URL` writes it after the upload.

A dataset at a URL this job may not write (a read-only bucket, a dataset others prepared) keeps
its entries in a local record instead, on each machine (storage.kept_here: DDPGPT_CACHE_DIR,
else ~/.cache/ddpgpt, / verified / <sha256 of the URL, 16 hex> / verified.json), in the same
format; an entry counts only while the object has the size and ETag (or version) it recorded,
so a shard rewritten at the URL is hashed again. Every start reads both; the local record is
written as well as the one at the URL, so a node's second start hashes nothing.

`prepare` writes it for the shards it has just written and hashed; a start that finds a shard
with no entry, another identity or another sha256 than meta.json's hashes it (the ranks split the
work), and the entries are added. What the cache cannot see is a change that does not go
through the filesystem's writes (bit rot on the disk): `ddpgpt prepare --verify DIR`
re-hashes every shard whatever the cache says (and refreshes it); deleting verified.json makes
the next start do the same. A dataset directory that cannot be written keeps no cache: its starts
hash every shard, as before (a warning says so, once per start).
"""

from __future__ import annotations

import json
from pathlib import Path

from ddpgpt.data import storage
from ddpgpt.data.shards import REPREPARE, ShardInfo, TokenDataset
from ddpgpt.errors import DataError, UserError, warn
from ddpgpt.files import WriteError, atomic_write, describe

CACHE = "verified.json"
CACHE_VERSION = 2  # 1: identities without the change time, hashed again once


def _files(where) -> storage.Directory | storage.Objects:
    """A dataset's files: `where` itself, or the directory or URL it names."""
    return where if hasattr(where, "identity") else storage.open_dir(where)


def read_cache(directory, name: str = CACHE) -> dict[str, dict]:
    """The cache's entries by file name; none when it is missing or unreadable."""
    files = _files(directory)
    try:
        cache = json.loads(files.read(name))
        if int(cache["version"]) != CACHE_VERSION:
            return {}
        return {str(k): dict(v) for k, v in cache["files"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError, UserError):
        return {}


def local_record(files) -> Path | None:
    """Where this machine keeps the entries of a dataset at a URL (None: a local directory,
    whose verified.json is beside the shards)."""
    return storage.kept_here("verified", files, CACHE) if isinstance(files, storage.Objects) \
        else None


def _read_local(files) -> dict[str, dict]:
    path = local_record(files)
    if path is None or not path.is_file():
        return {}
    return read_cache(storage.Directory(path.parent), path.name)


def stale(dataset: TokenDataset) -> list[ShardInfo]:
    """The shards whose bytes no cache vouches for (the one beside the shards, or this
    machine's record of a URL's): no entry, another identity, or another sha256 than meta.json
    lists."""
    files = dataset.files
    caches = [read_cache(files) if files.has(CACHE) else {}, _read_local(files)]
    out = []
    for info in dataset.infos():
        if not any(_vouches(c.get(info.file), info, files) for c in caches):
            out.append(info)
    return out


def _vouches(entry: dict | None, info: ShardInfo, files) -> bool:
    return entry is not None and entry.get("sha256") == info.sha256 and \
        entry.get("identity") == files.identity(info.file)


def hash_share(dataset: TokenDataset, part: int = 0, parts: int = 1,
               every: bool = False) -> dict[str, dict]:
    """Checks the sha256 of the shards of every `parts`-th one from `part` (a fixed share, so
    that ranks whose views of the cache differ still check every shard) that the cache does not
    vouch for (`every`: all of them) against meta.json; returns their cache entries. A mismatch
    is one line naming the shard."""
    files = dataset.files
    shards = dataset.infos()[part::parts]
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
    kept = _record_local(files, entries)
    cached = read_cache(files)
    cached.update(entries)
    data = (json.dumps({"version": CACHE_VERSION, "files": cached}, indent=0) + "\n").encode()
    try:
        try:
            files.write(CACHE, data)
        except OSError as e:
            raise WriteError(f"cannot write {files.where(CACHE)}: {describe(e)}") from None
    except UserError as e:
        if not quiet and not kept:
            warn(f"{e}: the shards' hashes are not remembered, so every start re-hashes them "
                 "(--data.verify false skips that)")
        return kept
    return True


def _record_local(files, entries: dict[str, dict]) -> bool:
    """A URL's entries added to this machine's record of it (local_record); False for a local
    directory, or when the record cannot be written."""
    path = local_record(files)
    if path is None:
        return False
    cached = _read_local(files)
    cached.update(entries)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_write(path) as f:
            f.write((json.dumps({"version": CACHE_VERSION, "files": cached}) + "\n").encode())
    except OSError:
        return False
    return True


def record_shards(directory, shards: dict[str, list[ShardInfo]]) -> None:
    """prepare: the shards it has just written and hashed (ShardWriter.close read them back),
    under their identity where they are now (a local directory, or the objects uploaded)."""
    files = _files(directory)
    record(files, {i.file: {"identity": files.identity(i.file), "sha256": i.sha256}
                   for infos in shards.values() for i in infos}, quiet=True)

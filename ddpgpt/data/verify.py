"""A dataset's shards checked against meta.json at every training start, at a cost that does not
grow with the dataset once its files are known.

Every start, every rank: each shard's header and size against meta.json (shards.TokenDataset
does it when it opens the dataset: a truncated, replaced or foreign file is one line). The
sha256 of a shard's bytes is checked once per file identity — (size, mtime_ns, ctime_ns,
inode): a file rewritten or copied has a new one, and so has one rewritten in place whose
modification time was set back (`touch -d`, `os.utime`), since the change time is the kernel's
and no call sets it — and remembered in `verified.json` in the dataset directory:

    {"version": 2, "files": {"train_000000.bin": {"identity": [size, mtime_ns, ctime_ns, inode],
                                                  "sha256": "..."}, ...}}

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
import os
from pathlib import Path

from ddpgpt.data.shards import REPREPARE, ShardInfo, TokenDataset
from ddpgpt.errors import DataError, warn
from ddpgpt.files import WriteError, replace_text, sha256

CACHE = "verified.json"
CACHE_VERSION = 2  # 1: identities without the change time, hashed again once


def identity(path: Path) -> list[int]:
    """What names one version of a file's bytes without reading them (see the module
    docstring); a packing cached beside the shards is keyed by it too (data/packing.py)."""
    st = os.stat(path)
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def read_cache(directory: Path) -> dict[str, dict]:
    """The cache's entries by file name; none when it is missing or unreadable."""
    try:
        cache = json.loads((Path(directory) / CACHE).read_text())
        if int(cache["version"]) != CACHE_VERSION:
            return {}
        return {str(k): dict(v) for k, v in cache["files"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


def stale(dataset: TokenDataset) -> list[ShardInfo]:
    """The shards whose bytes this cache does not vouch for: no entry, another identity, or
    another sha256 than meta.json lists."""
    cache = read_cache(dataset.path)
    out = []
    for info in (i for infos in dataset.shards.values() for i in infos):
        entry = cache.get(info.file)
        if entry is None or entry.get("sha256") != info.sha256 or \
                entry.get("identity") != identity(dataset.path / info.file):
            out.append(info)
    return out


def hash_share(dataset: TokenDataset, part: int = 0, parts: int = 1,
               every: bool = False) -> dict[str, dict]:
    """Checks the sha256 of the shards of every `parts`-th one from `part` (a fixed share, so
    that ranks whose views of the cache differ still check every shard) that the cache does not
    vouch for (`every`: all of them) against meta.json; returns their cache entries. A mismatch
    is one line naming the shard."""
    shards = [i for infos in dataset.shards.values() for i in infos][part::parts]
    todo = shards if every else [i for i in stale(dataset) if i in shards]
    entries = {}
    for info in todo:
        path = dataset.path / info.file
        before = identity(path)
        actual = sha256(path)
        if actual != info.sha256:
            raise DataError(f"{path}: sha256 mismatch (file {actual[:16]}, meta.json "
                            f"{info.sha256[:16]}): the shard changed after prepare; {REPREPARE}")
        entries[info.file] = {"identity": before, "sha256": actual}
    return entries


def check_all(dataset: TokenDataset) -> int:
    """`prepare --verify`: every shard re-hashed whatever the cache says, and the cache
    refreshed. Returns the number of shards."""
    entries = hash_share(dataset, every=True)
    record(dataset.path, entries, quiet=True)
    return len(entries)


def record(directory: Path, entries: dict[str, dict], quiet: bool = False) -> bool:
    """Adds `entries` to the cache (atomically). False, with a warning unless `quiet`, when the
    directory cannot be written."""
    if not entries:
        return True
    files = read_cache(directory)
    files.update(entries)
    try:
        replace_text(Path(directory) / CACHE,
                     json.dumps({"version": CACHE_VERSION, "files": files}, indent=0) + "\n")
    except WriteError as e:
        if not quiet:
            warn(f"{e}: the shards' hashes are not remembered, so every start re-hashes them "
                 "(--data.verify false skips that)")
        return False
    return True


def record_shards(directory: Path, shards: dict[str, list[ShardInfo]]) -> None:
    """prepare: the shards it has just written and hashed (ShardWriter.close read them back)."""
    record(directory, {i.file: {"identity": identity(Path(directory) / i.file), "sha256": i.sha256}
                       for infos in shards.values() for i in infos}, quiet=True)

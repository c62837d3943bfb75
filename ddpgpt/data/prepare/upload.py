"""`prepare --out URL`: a dataset (or a part) prepared into a local staging directory, then
uploaded with its marker last, so that it is visible only when complete.

    ddpgpt prepare SOURCES --out s3://bucket/data/edu        # meta.json uploaded last
    ddpgpt prepare SOURCES --part 2/8 --out s3://bucket/parts/2   # part.json last
    ddpgpt prepare --merge 's3://bucket/parts/*' --out s3://bucket/data/edu

The staging directory is `DDPGPT_CACHE_DIR/prepare/<hash of the URL>/` (~/.cache/ddpgpt by
default): the prepare runs there exactly as for a local --out (resumable, in .NAME.partial);
once it is finished, `staged.json` records its settings and every file but the marker is
uploaded (an object already there with the same bytes is not sent again: its ETag is their MD5,
storage.same; one of the same size but other bytes, from a dataset replaced with --force, is),
then verified.json (the shards' hashes under their objects' identities, so a training start
hashes none), then the marker. An upload cut short (Ctrl-C,
SIGKILL, the server gone) leaves the staging finished and no marker at the URL: the same command
uploads what is missing, and the objects are the same bytes whatever was cut. Merging parts at
URLs downloads them into the staging directory first, again whenever a part's objects (names,
sizes, ETags) are not those its copy there was downloaded from (fetch_part).
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
from pathlib import Path

from ddpgpt.data import storage
from ddpgpt.data.verify import CACHE, record_shards
from ddpgpt.errors import UserError
from ddpgpt.files import atomic_write

MARKERS = ("meta.json", "part.json")  # what marks a dataset, or a part, complete
STAGED = "staged.json"
FETCHED = ".fetched.json"  # a downloaded part's objects (fetch_part)


def cache_dir() -> Path:
    return Path(os.environ.get("DDPGPT_CACHE_DIR") or Path.home() / ".cache" / "ddpgpt")


def staging(url: str) -> Path:
    """The local directory a prepare into `url` works in (its .NAME.partial is beside it)."""
    digest = hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:16]
    return cache_dir() / "prepare" / digest / storage.name_of(url)


def check_remote(url: str, force: bool) -> storage.Objects:
    """--out URL: its bucket reachable, and no dataset there unless --force."""
    objects = storage.Objects(url)
    if objects.has("meta.json") and not force:
        raise UserError(f"--out {url} holds a dataset (meta.json); pass --force to replace it")
    return objects


def staged(tmp: Path, settings: dict) -> bool:
    """A staging finished by an earlier run of the same prepare, its upload not done."""
    try:
        same = json.loads((tmp / STAGED).read_text()) == json.loads(json.dumps(settings))
    except (OSError, ValueError):
        return False
    return same and any((tmp / m).is_file() for m in MARKERS)


def mark(tmp: Path, settings: dict) -> None:
    with atomic_write(tmp / STAGED) as f:
        f.write(json.dumps(settings).encode())


def publish(tmp: Path, url: str) -> float:
    """Uploads the finished staging `tmp` to `url`, its marker last; returns the MB uploaded
    (what the dataset holds). A dataset there before (--force) is unpublished first (its
    meta.json deleted) and its objects that the new one does not have are deleted last."""
    objects = storage.Objects(url)
    marker = next(m for m in MARKERS if (tmp / m).is_file())
    names = sorted(p.name for p in tmp.iterdir() if p.is_file()
                   and p.name not in (marker, STAGED, CACHE, "lock") and not p.name.startswith("."))
    there = objects.listing(fresh=True)
    old = [n for n in there if n not in names and n not in (marker, CACHE)]
    if marker in there:
        objects.delete([marker])
    for name in names:
        if storage.same(there.get(name), tmp / name):
            continue  # these bytes are there (an earlier run's upload, cut short): not sent again
        objects.upload(tmp / name, name)
    for sub in ("units",):  # a part's unit files
        if (tmp / sub).is_dir():
            for path in sorted((tmp / sub).rglob("*")):
                if path.is_file():
                    objects.upload(path, f"{sub}/{path.relative_to(tmp / sub)}")
    if marker == "meta.json":
        meta = json.loads((tmp / marker).read_text())
        from ddpgpt.data.shards import ShardInfo
        objects.listing(fresh=True)
        record_shards(objects, {s: [ShardInfo(**i) for i in infos]
                                for s, infos in meta["shards"].items()})
    objects.upload(tmp / marker, marker)  # last: the dataset (or part) is complete
    if old:
        objects.delete(old)
    return sum(p.stat().st_size for p in tmp.rglob("*") if p.is_file()) / 1e6


def fetch_parts(specs: list[str]) -> list[str]:
    """--merge's sources with the URLs among them (globs too) downloaded into the staging: each
    a local part directory."""
    out = []
    for spec in specs:
        if not storage.is_url(spec):
            out += sorted(glob.glob(spec)) if glob.has_magic(spec) else [spec]
            continue
        fs, path = storage.filesystem(spec)
        scheme = spec.split("://", 1)[0]
        with storage.failing(spec, "listing", UserError):
            found = sorted(fs.glob(path)) if glob.has_magic(spec) else [path]
        for part in found:
            out.append(str(fetch_part(fs, part, f"{scheme}://{part}")))
    return out


def fetch_part(fs, part: str, url: str) -> Path:
    """One part at a URL, downloaded into its staging directory unless the copy there is of
    the objects the URL holds now: the part's listing (every object's name, size and ETag or
    version, one request) is recorded beside the copy (FETCHED), so a part prepared again at
    the same URL is downloaded again, and an unchanged one is not."""
    local = staging(url)
    with storage.failing(url, "downloading", UserError):
        listing = fs.find(part, detail=True)
        if f"{part}/part.json" not in listing:
            raise UserError(f"--merge: {url} is not a finished part (no part.json); "
                            "prepare it with --part I/N first")
        identity = sorted([name[len(part) + 1:], int(info.get("size") or 0), storage.tag(info)]
                          for name, info in listing.items() if info.get("type") != "directory")
        try:
            kept = json.loads((local / FETCHED).read_text())
        except (OSError, ValueError):
            kept = None
        if kept == identity and (local / "part.json").is_file():
            return local
        shutil.rmtree(local, ignore_errors=True)
        for name, _, _ in sorted(identity, key=lambda e: e[0] == "part.json"):
            target = local / name  # part.json last, then FETCHED: a cut download is redone
            target.parent.mkdir(parents=True, exist_ok=True)
            fs.get_file(f"{part}/{name}", str(target))
    with atomic_write(local / FETCHED) as f:
        f.write(json.dumps(identity).encode())
    return local

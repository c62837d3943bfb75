"""Where a run's checkpoints are: a local directory (a `pathlib.Path`: files.py's durable writes,
renames and fsyncs) or a prefix of object storage (`Remote`: s3://BUCKET/PREFIX through fsspec,
the cloud extra), behind the few operations the store uses (store.py, read.py, saver.py).

`Remote` answers what the store asks of a path (name, parent, `/`, is_dir, iterdir, read_bytes,
unlink ...), so the store's code is one path; what differs is here, decided by the path's type:

    operation          a local directory                  object storage
    write a file       write + fsync (files.write_bytes)  one PUT: whole or absent
    publish            a temporary directory renamed      meta.json written last: a step
                                                          prefix without it is not a checkpoint
                                                          (a step there complete already: the
                                                          new one beside it, then copied in,
                                                          store._publish)
    delete             renamed away, then removed         meta.json first (unpublished), then
                                                          the rest
    set aside          renamed                            copied server-side, then deleted
    verify on load     every file's sha256                every object's size and ETag, as
                                                          meta.json recorded them at commit
                                                          (one listing); the small files'
                                                          sha256 on the bytes read
                                                          (read.read_verified)

A step prefix in object storage is never renamed: DCP's writers put their objects straight under
`step_NNNNNNN/` (a step saved again: beside it, store.temporary), rank 0 writes meta.json last,
and a reader takes a step only with its meta.json. An upload cut short (a killed writer, the
server gone) leaves objects without one: never loaded, and removed at the next start
(store.remove_temporaries) or by the next save of that step. Object stores give
read-after-write consistency (S3 since 2020, GCS, MinIO), which this relies on: a meta.json seen
means every object it lists is there.
"""

from __future__ import annotations

import fnmatch
import json
import os
import shutil
import socket
from pathlib import Path

from ddpgpt.data import storage
from ddpgpt.errors import UserError
from ddpgpt.files import WriteError, atomic_write, fsync, write_bytes
from ddpgpt.files import move as move_path
from ddpgpt.files import sha256 as sha256_file


class Remote:
    """A path in object storage with the few pathlib methods the checkpoint store uses."""

    def __init__(self, url: str, fs=None, key: str | None = None, kind: str | None = None):
        self.url = url.rstrip("/")
        self._fs, self._key = fs, key
        self._kind = kind  # "file" or "directory" when a listing said so

    def _open(self) -> None:
        if self._fs is None:
            self._fs, key = storage.filesystem(self.url)
            self._key = self._key or key.rstrip("/")

    @property
    def fs(self):
        self._open()
        return self._fs

    @property
    def key(self) -> str:
        self._open()
        return self._key

    def __str__(self) -> str:
        return self.url

    def __repr__(self) -> str:
        return f"Remote({self.url!r})"

    def __eq__(self, other) -> bool:
        return isinstance(other, Remote) and other.url == self.url

    def __hash__(self) -> int:
        return hash(self.url)

    def __truediv__(self, name: str) -> Remote:
        return Remote(f"{self.url}/{name}", self._fs,
                      f"{self._key}/{name}" if self._key is not None else None)

    @property
    def name(self) -> str:
        return self.url.rsplit("/", 1)[-1]

    @property
    def parent(self) -> Remote:
        url = self.url.rsplit("/", 1)[0]
        key = self._key.rsplit("/", 1)[0] if self._key and "/" in self._key else None
        return Remote(url, self._fs if key else None, key)

    def with_name(self, name: str) -> Remote:
        return self.parent / name

    def resolve(self) -> Remote:
        return self

    def _listing(self) -> list[dict]:
        """fsspec's info of what is under this prefix (none for a plain object)."""
        return storage.list_under(self.fs, self.key, self.url, UserError)

    def iterdir(self) -> list[Remote]:
        out = []
        for info in self._listing():
            name = info["name"].rstrip("/").rsplit("/", 1)[-1]
            if name:
                out.append(Remote(f"{self.url}/{name}", self._fs, f"{self.key}/{name}",
                                  info.get("type")))
        return out

    def glob(self, pattern: str) -> list[Remote]:
        return [p for p in self.iterdir() if fnmatch.fnmatch(p.name, pattern)]

    def is_dir(self) -> bool:
        if self._kind is not None:
            return self._kind == "directory"
        return bool(self._listing())

    def is_file(self) -> bool:
        if self._kind is not None:
            return self._kind == "file"
        with storage.failing(self.url, "reading", UserError):
            return self.fs.isfile(self.key)

    def exists(self) -> bool:
        return self.is_file() or self.is_dir()

    def read_bytes(self) -> bytes:
        """FileNotFoundError when there is no such object, as for a file."""
        with storage.failing(self.url, "reading", UserError):
            return self.fs.cat_file(self.key)

    def read_text(self) -> str:
        return self.read_bytes().decode()

    def unlink(self, missing_ok: bool = False) -> None:
        with storage.failing(self.url, "deleting", WriteError):
            try:
                self.fs.rm_file(self.key)
            except FileNotFoundError:
                if not missing_ok:
                    raise

    def mkdir(self, parents: bool = False, exist_ok: bool = False) -> None:
        """Nothing to make: a prefix exists once an object is under it."""


def at(where) -> Path | Remote:
    """A checkpoint root or directory: a URL's Remote, else a local Path."""
    if isinstance(where, Remote):
        return where
    return Remote(where) if storage.is_url(str(where)) else Path(where)


def is_remote(path) -> bool:
    return isinstance(path, Remote)


def children(root: Path | Remote) -> list:
    """What a directory or prefix holds (nothing when it does not exist): one listing."""
    if isinstance(root, Remote):
        return root.iterdir()
    return list(root.iterdir()) if root.is_dir() else []


def write_file(path: Path | Remote, data: bytes) -> None:
    """A file written durably (fsynced) or one object PUT; OSError on a local failure,
    WriteError (one line) on a remote one."""
    if isinstance(path, Remote):
        with storage.failing(path.url, "writing", WriteError):
            path.fs.pipe_file(path.key, data)
        return
    write_bytes(path, data)


def replace_file(path: Path | Remote, data: bytes) -> None:
    """`path` replaced whole or not at all (files.atomic_write; an object PUT is that already)."""
    if isinstance(path, Remote):
        write_file(path, data)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(path) as f:
        f.write(data)


def sync(path: Path | Remote) -> None:
    """A local directory's names on the disk (fsync); an object store has nothing to sync."""
    if not isinstance(path, Remote):
        fsync(path)


def remove_tree(path: Path | Remote) -> None:
    """A directory or prefix and everything in it, quietly (nothing there is fine)."""
    if not isinstance(path, Remote):
        shutil.rmtree(path, ignore_errors=True)
        return
    try:
        names = [p.key for p in _walk(path)]
        if names:
            path.fs.rm(names)
    except Exception:  # what is left has no meta.json: never loaded, removed at a later start
        pass


def _walk(path: Remote) -> list[Remote]:
    out = []
    for child in path.iterdir():
        out += _walk(child) if child.is_dir() else [child]
    return out


def delete_checkpoint(path: Path | Remote, token: str) -> None:
    """A checkpoint deleted so that no reader sees half of one: renamed away first (locally), or
    unpublished by deleting its meta.json first (object storage). OSError or WriteError."""
    if isinstance(path, Remote):
        (path / "meta.json").unlink(missing_ok=True)
        remove_tree(path)
        return
    doomed = path.with_name(f".del-{path.name}-{token}")
    move_path(path, doomed)
    shutil.rmtree(doomed)


def move(source: Path | Remote, target: Path | Remote) -> None:
    """A checkpoint (or a file) moved: renamed locally; in object storage copied server-side
    under the new prefix, meta.json last, then deleted where it was (meta.json first)."""
    if not isinstance(source, Remote):
        target.parent.mkdir(parents=True, exist_ok=True)
        move_path(source, target)
        return
    with storage.failing(source.url, "moving", WriteError):
        if not source.is_dir():
            source.fs.copy(source.key, target.key)
            source.unlink()
            return
        files = [f for f in _walk(source) if f.name != "meta.json"]
        for f in files:
            source.fs.copy(f.key, target.key + f.key[len(source.key):])
        _copy_meta(source, target)  # last: it publishes the copy
    delete_checkpoint(source, "moved")


def _copy_meta(source: Remote, target: Remote) -> None:
    """A checkpoint's meta.json copied after its objects, with the ETags of the copies (a server
    side copy of an object uploaded in parts gets another): each one carried over only where the
    source's object still had the ETag recorded, so a replaced object stays refused."""
    try:
        data = (source / "meta.json").read_bytes()
    except FileNotFoundError:
        return  # not a complete checkpoint: moved as it is
    try:
        meta = json.loads(data)
    except ValueError:  # corrupt: refused where it is copied to as where it was
        meta = {}
    if isinstance(meta, dict) and meta.get("etags"):
        was, now = listed(source), listed(target)
        meta["etags"] = {name: now[name][1] if name in now and was.get(name, (0, ""))[1] == tag
                         else tag for name, tag in meta["etags"].items()}
        data = (json.dumps(meta, indent=1) + "\n").encode()
    write_file(target / "meta.json", data)


def sha256(path: Path | Remote) -> str:
    if not isinstance(path, Remote):
        return sha256_file(path)
    with storage.failing(path.url, "reading", UserError):
        size = path.fs.size(path.key)
    return storage.hash_object(path.fs, path.key, size, path.url, UserError)


def listed(directory: Path | Remote) -> dict[str, tuple[int, str]]:
    """{name: (bytes, tag)} of the files in a checkpoint directory, from one listing of a
    prefix: an object's tag is its ETag or version (storage.tag), which a rewrite changes even
    at the same size; a local file's is "" (its sha256 is what a load checks)."""
    if isinstance(directory, Remote):
        return {info["name"].rstrip("/").rsplit("/", 1)[-1]: (int(info["size"]), storage.tag(info))
                for info in directory._listing() if info.get("type") == "file"}
    return {p.name: (p.stat().st_size, "") for p in Path(directory).iterdir() if p.is_file()}


def sizes(directory: Path | Remote) -> dict[str, int]:
    """{name: bytes} of the files in a checkpoint directory (one listing of a prefix)."""
    return {name: size for name, (size, _) in listed(directory).items()}


def check_url(url: str, flag: str = "--run.checkpoint-url") -> None:
    """A URL of object storage with a bucket (s3://BUCKET/PREFIX, gs://...), or one line: a
    local path, a scheme that is not object storage (a typo: s4://, https://) or no bucket."""
    scheme, _, rest = url.partition("://") if storage.is_url(url) else ("", "", "")
    give = "give s3://BUCKET/PREFIX (or gs://BUCKET/PREFIX)"
    if not scheme:
        raise UserError(f"{flag} {url}: not a URL of object storage; {give}, or leave it out to "
                        "keep the checkpoints in the run dir (--run-dir)")
    if scheme.lower() not in storage.PACKAGES:
        raise UserError(f"{flag} {url}: {scheme}:// is not object storage ddpgpt knows "
                        f"({', '.join(f'{s}://' for s in storage.PACKAGES)}); {give}")
    if not rest.split("/", 1)[0]:
        raise UserError(f"{flag} {url}: no bucket; {give}")


def check_writable(url: str) -> None:
    """run.checkpoint_url, before anything trains: a URL of object storage (check_url), its bucket
    exists, the credentials work and may write and delete there (a probe object written and
    removed), or one line saying which."""
    check_url(url)
    root = at(url)
    root.iterdir()  # the bucket, the credentials, the endpoint
    probe = root / f".probe-{socket.gethostname()}-{os.getpid()}"
    write_file(probe, b"")
    probe.unlink(missing_ok=True)


def describe_where(path: Path | Remote) -> str:
    """How messages name a checkpoint root: its run dir (a local checkpoints/'s parent) or its
    URL."""
    return str(path) if isinstance(path, Remote) else str(Path(path).parent)


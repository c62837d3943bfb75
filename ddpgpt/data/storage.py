"""Where a dataset's files are: a local directory, or a prefix of object storage named by a URL
(s3://BUCKET/PREFIX, and anything that speaks S3's API: MinIO, Ceph, R2; gs:// for GCS), read
through one small interface (`open_dir`).

    files = open_dir("s3://bucket/data/edu")   # or open_dir("data/edu")
    meta = files.read("meta.json")
    reader = files.reader(cache="/scratch/ddpgpt")  # windows: ranged reads, fetched ahead

Object storage goes through fsspec (s3fs, gcsfs: the `cloud` and `gcs` extras), imported only when
a URL is used. Credentials and the endpoint are the ecosystem's own: AWS_ENDPOINT_URL,
AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_DEFAULT_REGION or ~/.aws/config and credentials,
read by botocore; nothing ddpgpt-specific. A failure (no such bucket, access denied, no
credentials, an endpoint that does not answer) is one line naming the URL and the fix
(`failing`).

Reading a window is a ranged GET of exactly its bytes (fetch.RemoteReader): a rank reads its own
windows and nothing else. A GET costs a round trip (20-100 ms on a cloud's store), so the loader
names the windows of the next steps ahead (`prefetch`), each step's fetched in one concurrent
batch by a background thread while the steps compute: ceil(arrival / step) + 1 steps ahead,
as the reader measures a fetch's arrival (fetch.ahead_steps: 2 to 16 steps, 64 MiB of windows
at most), those batches in flight together on POOL_CONNECTIONS connections (botocore's 10 would
queue them), so a step waits only when bandwidth is short. With a cache directory (data.cache,
per node), what is read is kept in blocks of fetch.CACHE_BLOCK bytes, each written whole
(files.atomic_write), keyed by the object's URL and identity (size and ETag), so later epochs,
restarts and the node's other ranks read it from the local disk; a block is fetched whole, so
with the cache a rank reads the blocks around its windows, not only the windows.

An object's identity is its size and ETag (or version id): an object rewritten gets a new one,
as a local file rewritten gets a new (size, mtime, inode); a file:// URL's file (no ETag) has
the local file's.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import os
import re
from pathlib import Path

from ddpgpt.data.fetch import LocalReader, RemoteReader
from ddpgpt.errors import DataError, UserError
from ddpgpt.files import atomic_write, missing, require, sha256, writable_dir

URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
PACKAGES = {"s3": ("s3fs", "cloud"), "s3a": ("s3fs", "cloud"), "gs": ("gcsfs", "gcs"),
            "gcs": ("gcsfs", "gcs")}
HASH_BLOCK = 8 << 20  # bytes read at a time when hashing an object
PART = 50 << 20  # an upload's part size (s3fs's multipart put_file): its ETag depends on it
POOL_CONNECTIONS = 128  # an S3 client's connections at most (botocore's max_pool_connections)


def is_url(where) -> bool:
    """`where` names object storage (scheme://...), not a local path."""
    return isinstance(where, str) and bool(URL.match(where))


def filesystem(url: str):
    """(fsspec filesystem, path inside it) for `url`; one line when what it needs is missing."""
    scheme = url.split("://", 1)[0].lower()
    package, extra = PACKAGES.get(scheme, (scheme, "cloud"))
    fsspec = require("fsspec", "cloud", url)
    from fsspec import asyn  # the loop that runs every request of fsspec's async filesystems

    asyn.get_loop().set_exception_handler(_orphaned_requests)
    try:
        return fsspec.core.url_to_fs(url, use_listings_cache=False, **client_options(url))
    except ImportError:
        raise UserError(missing(package, extra, url)) from None
    except ValueError as e:
        raise UserError(f"{url}: {e}; give an s3:// (or gs://) URL, or a local path") from None


def client_options(url: str) -> dict:
    """fsspec's options for `url`'s client: an S3 client keeps POOL_CONNECTIONS connections."""
    s3 = PACKAGES.get(url.split("://", 1)[0].lower(), ("",))[0] == "s3fs"
    return {"config_kwargs": {"max_pool_connections": POOL_CONNECTIONS}} if s3 else {}


def _orphaned_requests(loop, context: dict) -> None:
    """The IO loop's handler of errors no one awaited: a transfer cut by the network (the server
    gone mid-upload) leaves the other requests of its batch failing unawaited, and asyncio would
    print each with a traceback after the failure was already reported as one line. Those are
    dropped; anything else goes to asyncio's default handler."""
    error = context.get("exception")
    orphan = context.get("message", "").startswith("Task exception was never retrieved")
    network = isinstance(error, OSError) or type(error).__module__.split(".")[0] in (
        "aiohttp", "botocore", "aiobotocore")
    if not (orphan and network):
        loop.default_exception_handler(context)


def endpoint(where: str = "s3://") -> str:
    """Where the requests for `where` go, as messages name it: for s3:// the S3 endpoint that
    AWS_ENDPOINT_URL names (MinIO, Ceph, R2 or AWS itself), AWS S3 when it is unset; GCS."""
    if where.split("://", 1)[0].lower() in ("gs", "gcs"):
        return "GCS"
    url = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    return f"the S3 endpoint {url}" if url else "AWS S3 (AWS_ENDPOINT_URL unset)"


def explain(error: BaseException, where: str, doing: str) -> str | None:
    """One line for a failure of object storage while `doing` (reading, writing, listing) at
    `where`, naming the endpoint and the variables that set it, or None when `error` is not one
    (a bug keeps its traceback)."""
    name, text = type(error).__name__, str(error).strip().splitlines()[0] if str(error) else ""
    bucket = where.split("://", 1)[-1].split("/", 1)[0]
    at, s3 = endpoint(where), endpoint(where) != "GCS"
    keys, alt = (("AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY", "~/.aws/credentials") if s3 else
                 ("GOOGLE_APPLICATION_CREDENTIALS", "gcloud auth application-default login"))
    if isinstance(error, FileNotFoundError) and "bucket" in text.lower():
        return (f"{doing} {where}: the bucket {bucket} does not exist at {at}; create it, or fix "
                f"the URL{' (or AWS_ENDPOINT_URL)' if s3 else ''}")
    if isinstance(error, PermissionError):
        may = "write" if doing.startswith(("writ", "delet", "upload")) else "read"
        return (f"{doing} {where}: access denied by {at} ({text or 'Forbidden'}): the "
                f"credentials ({keys}, or {alt}) are wrong, or may not {may} there")
    if name in ("NoCredentialsError", "PartialCredentialsError"):
        return f"{doing} {where}: no credentials for {at} ({text}); set {keys} (or {alt})"
    if name in ("EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError",
                "ConnectionClosedError", "ClientConnectorError", "ServerDisconnectedError") \
            or isinstance(error, ConnectionError):
        return (f"{doing} {where}: cannot reach {at} ({text or name}); check "
                f"{'AWS_ENDPOINT_URL and ' if s3 else ''}that the server is up")
    if isinstance(error, OSError) and not isinstance(error, FileNotFoundError):
        return f"{doing} {where}: {text or name}"
    return None


@contextlib.contextmanager
def failing(where: str, doing: str, kind: type[UserError] = DataError):
    """Object storage's failures inside the block as one line (`explain`), raised as `kind`
    with its `storage` set to `where` (a training names its step and newest checkpoint around
    it: commands/train.py)."""
    try:
        yield
    except UserError:
        raise
    except Exception as e:  # botocore's exceptions are not OSErrors
        line = explain(e, where, doing)
        if line is None:
            raise
        error = kind(line)
        error.storage = where
        raise error from None


# ---- what a dataset's and a checkpoint's prefixes share (checkpoint/location.py) ------------

def list_under(fs, key: str, url: str, kind: type[UserError] = DataError) -> list[dict]:
    """fsspec's info of what is right under the prefix `key` (of `url`, which messages name):
    nothing when there is nothing, or when `key` names an object (a listing of an object's key
    answers with the object itself); an unknown bucket or another failure as one line (`kind`)."""
    with failing(url, "listing", kind):
        try:
            found = fs.ls(key, detail=True, refresh=True)
        except FileNotFoundError as e:
            if "bucket" in str(e).lower():
                raise
            return []
    inside = key.rstrip("/") + "/"
    return [i for i in found if i["name"].startswith(inside)]


def hash_object(fs, key: str, size: int, url: str, kind: type[UserError] = DataError) -> str:
    """The sha256 of an object's `size` bytes, read HASH_BLOCK bytes at a time."""
    digest = hashlib.sha256()
    with failing(url, "reading", kind):
        for start in range(0, size, HASH_BLOCK):
            digest.update(fs.cat_file(key, start=start, end=min(size, start + HASH_BLOCK)))
    return digest.hexdigest()


# ---- a directory of files ------------------------------------------------------------------

def file_identity(path: str | os.PathLike) -> list:
    """A local file's [size, mtime_ns, ctime_ns, inode]: a file rewritten gets another, even one
    rewritten in place with its modification time set back (the change time is the kernel's)."""
    st = os.stat(path)
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def _local(fs) -> bool:
    """fsspec's filesystem of local files (a file:// URL)."""
    protocol = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    return "file" in protocol


class Directory:
    """A local dataset directory."""

    remote = False

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)

    def __str__(self) -> str:
        return str(self.path)

    def where(self, name: str) -> str:
        return str(self.path / name)

    def exists(self) -> bool:
        return self.path.exists()

    def has(self, name: str) -> bool:
        return (self.path / name).is_file()

    def read(self, name: str) -> bytes:
        """OSError when it cannot (the caller says what it means)."""
        return (self.path / name).read_bytes()

    def size(self, name: str) -> int:
        return (self.path / name).stat().st_size

    def identity(self, name: str) -> list:
        return file_identity(self.path / name)

    def sha256(self, name: str) -> str:
        return sha256(self.path / name)

    def write(self, name: str, data: bytes) -> None:
        """Whole or not at all; OSError on failure."""
        with atomic_write(self.path / name) as f:
            f.write(data)

    def reader(self, cache: str = "") -> LocalReader:
        return LocalReader(self)


class Objects:
    """A prefix of object storage as a dataset directory. Its listing (names, sizes, ETags) is
    taken once, when first needed: a dataset's objects do not change under a run."""

    remote = True

    def __init__(self, url: str):
        self.url = url.rstrip("/")
        self.fs, self.root = filesystem(self.url)
        self._listing: dict[str, dict] | None = None

    def __str__(self) -> str:
        return self.url

    def where(self, name: str) -> str:
        return f"{self.url}/{name}"

    def key(self, name: str) -> str:
        return f"{self.root}/{name}"

    def listing(self, fresh: bool = False) -> dict[str, dict]:
        """{name: fsspec's info} of the objects right under the prefix."""
        if self._listing is None or fresh:
            self._listing = {i["name"].rstrip("/").rsplit("/", 1)[-1]: i
                             for i in list_under(self.fs, self.root, self.url)
                             if i.get("type") == "file"}
        return self._listing

    def exists(self) -> bool:
        return bool(self.listing())

    def has(self, name: str) -> bool:
        return name in self.listing()

    def beside(self) -> str:
        """For a prefix with nothing under it that names an object (a dataset's meta.json, say):
        " (did you mean PREFIX?)", the prefix that object is in; else ""."""
        with failing(self.url, "reading"):
            named = self.fs.isfile(self.root)
        return f" (did you mean {self.url.rsplit('/', 1)[0]}? it names an object)" if named else ""

    def read(self, name: str) -> bytes:
        with failing(self.where(name), "reading"):
            return self.fs.cat_file(self.key(name))

    def size(self, name: str) -> int:
        return int(self.listing()[name]["size"])

    def identity(self, name: str) -> list:
        """[size, ETag or version]: a rewritten object gets another. A file:// URL's file (which
        has no ETag) has a local file's identity."""
        if _local(self.fs):
            return file_identity(self.key(name))
        info = self.listing()[name]
        return [int(info["size"]), tag(info)]

    def sha256(self, name: str) -> str:
        return hash_object(self.fs, self.key(name), self.size(name), self.where(name))

    def ranges(self, requests: list[tuple[str, int, int]]) -> list[bytes]:
        """The bytes of each (name, start, end), fetched concurrently."""
        if not requests:
            return []
        names, starts, ends = zip(*requests)
        with failing(self.where(names[0]), "reading"):
            got = self.fs.cat_ranges([self.key(n) for n in names], list(starts), list(ends),
                                     on_error="raise")
        for data in got:
            if isinstance(data, BaseException):
                raise data
        return got

    def write(self, name: str, data: bytes) -> None:
        """One PUT: the object appears whole or not at all."""
        with failing(self.where(name), "writing"):
            self.fs.pipe_file(self.key(name), data)
        self._listing = None

    def upload(self, local: Path, name: str) -> None:
        extra = {"chunksize": PART} if self.url.startswith(("s3://", "s3a://")) else {}
        with failing(self.where(name), "uploading"):
            self.fs.put_file(str(local), self.key(name), **extra)
        self._listing = None

    def delete(self, names: list[str]) -> None:
        if names:
            with failing(self.url, "deleting"):
                self.fs.rm([self.key(n) for n in names])
        self._listing = None

    def reader(self, cache: str = "") -> RemoteReader:
        return RemoteReader(self, cache)


def tag(info: dict) -> str:
    """What changes when an object is rewritten, from fsspec's `info` of it (a listing's entry):
    its version id, else its ETag (S3), MD5 or generation (GCS); "" when the server gives none."""
    found = info.get("VersionId") or info.get("ETag") or info.get("etag") or \
        info.get("md5Hash") or info.get("generation") or ""
    return str(found).strip('"')


def same(info: dict | None, local: Path) -> bool:
    """The object that fsspec's `info` describes (a listing's entry) has the bytes of the local
    file `local`: its ETag is their MD5 as S3 computes it for `Objects.upload` (of the whole, or
    of its PART-byte parts), or GCS's md5Hash is. False when its checksum is of another kind
    (server-side encryption with KMS, say): then it cannot be told, and the caller sends it
    again."""
    if info is None or int(info["size"]) != local.stat().st_size:
        return False
    if info.get("md5Hash"):  # GCS: base64 of the whole object's MD5
        return base64.b64encode(_md5s(local, None)[0]).decode() == info["md5Hash"]
    there = str(info.get("ETag") or info.get("etag") or "").strip('"')
    return bool(there) and there == etag(local)


def _md5s(path: Path, part: int | None) -> list[bytes]:
    """The MD5 digest of each `part`-byte piece of the file at `path` (of the whole: None)."""
    digests, digest, filled = [], hashlib.md5(usedforsecurity=False), 0
    with open(path, "rb") as f:
        while block := f.read(min(HASH_BLOCK, (part - filled) if part else HASH_BLOCK)):
            digest.update(block)
            filled += len(block)
            if part and filled == part:
                digests.append(digest.digest())
                digest, filled = hashlib.md5(usedforsecurity=False), 0
    if filled or not digests:
        digests.append(digest.digest())
    return digests


def etag(path: Path) -> str:
    """The ETag S3 gives the object that `Objects.upload` makes of the file at `path`: the MD5
    of its bytes when sent in one PUT (under 2 PARTs), else the MD5 of its parts' MD5s, "-" and
    the number of parts."""
    if path.stat().st_size < 2 * PART:
        return _md5s(path, None)[0].hex()
    parts = _md5s(path, PART)
    return f"{hashlib.md5(b''.join(parts), usedforsecurity=False).hexdigest()}-{len(parts)}"


def open_dir(where: str | os.PathLike) -> Directory | Objects:
    """A dataset directory: a local path, or a URL of object storage (or what names one)."""
    if not isinstance(where, (str, os.PathLike)):
        where = str(where)  # a checkpoint.location.Remote: its URL
    return Objects(where) if is_url(where) else Directory(where)


def name_of(where: str | os.PathLike) -> str:
    """The last component of a path or URL (a dataset's name in metrics)."""
    if is_url(where):
        return str(where).rstrip("/").rsplit("/", 1)[-1]
    return Path(where).resolve().name or str(where)


def check_cache(cache: str) -> None:
    """data.cache: a directory this process can write (created), or one line."""
    if cache:
        writable_dir(Path(cache), "--data.cache")


def kept_here(kind: str, where, name: str) -> Path:
    """Where this machine keeps `name` for a dataset at a URL that it may not be able to write
    there (`kind`: "verified", "packing"): DDPGPT_CACHE_DIR (else ~/.cache/ddpgpt) / KIND /
    <sha256 of the URL, 16 hex> / NAME."""
    home = Path(os.environ.get("DDPGPT_CACHE_DIR") or Path.home() / ".cache" / "ddpgpt")
    return home / kind / hashlib.sha256(str(where).rstrip("/").encode()).hexdigest()[:16] / name

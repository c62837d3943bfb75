"""Fixtures shared by all tests: a small real-text dataset and a tiny training command line."""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

import pytest

from ddpgpt.config.commands import PrepareConfig
from ddpgpt.data.prepare import main as prepare
from tests.helpers import TIKTOKEN_GPT2

STDLIB = Path(sysconfig.get_paths()["stdlib"])
if TIKTOKEN_GPT2.is_dir():  # GPT-2's files for tiktoken, offline (tests and their subprocesses)
    os.environ.setdefault("TIKTOKEN_CACHE_DIR", str(TIKTOKEN_GPT2))
CORPUS = ["textwrap.py", "shlex.py", "bisect.py", "heapq.py", "fnmatch.py", "glob.py",
          "colorsys.py", "keyword.py"]


@pytest.fixture(scope="session", autouse=True)
def own_cache(tmp_path_factory):
    """DDPGPT_CACHE_DIR of this session alone (tests and their subprocesses): what a start
    keeps on the machine for a dataset at a URL (its shards' hashes, its packing) is found
    again only by the tests of the session that made it, not by a later session whose server
    reuses the same bucket names."""
    os.environ["DDPGPT_CACHE_DIR"] = str(tmp_path_factory.mktemp("ddpgpt-cache"))


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> Path:
    """~90 KB of standard-library source as a byte-level dataset (2 val documents)."""
    out = tmp_path_factory.mktemp("data") / "tiny"
    prepare.run(PrepareConfig(sources=[str(STDLIB / f) for f in CORPUS], out=str(out),
                              tokenizer="byte", val_fraction=0.2))
    return out


@pytest.fixture(scope="session")
def chat_data(tmp_path_factory) -> Path:
    """300 conversations (tests/helpers.write_conversations) as a byte+chat dataset with loss
    masks, 10% of them val."""
    from tests.helpers import write_conversations

    tmp = tmp_path_factory.mktemp("chat")
    src = write_conversations(tmp / "chats.jsonl", 300)
    prepare.run(PrepareConfig(sources=[str(src)], out=str(tmp / "chat"), tokenizer="byte",
                              chat=True, val_fraction=0.1, workers=1))
    return tmp / "chat"


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """A real S3 server (moto's, tests/s3.py) on a free localhost port for the whole session.
    Nothing points at it unless a test asks for `s3`."""
    from tests.s3 import S3Server

    server = S3Server.start(tmp_path_factory.mktemp("s3"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3(s3_server, monkeypatch):
    """The S3 server, and for this test only its variables (AWS_ENDPOINT_URL, its keys ...) in
    this process and the subprocesses it starts; s3fs's cached clients are dropped on the way in
    and out, so none made under other variables is used here, nor one made here later."""
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    for key, value in s3_server.env().items():
        monkeypatch.setenv(key, value)
    yield s3_server
    s3fs.S3FileSystem.clear_instance_cache()


@pytest.fixture(scope="session")
def s3_dataset(s3_server, tiny_data) -> str:
    """tiny_data uploaded as it is (meta.json last), once: the URL of a prepared dataset in S3."""
    url = s3_server.bucket("data") + "/tiny"
    fs = s3_server.fs()
    for path in sorted(tiny_data.iterdir(), key=lambda p: p.name == "meta.json"):
        if path.is_file() and path.name != "verified.json":
            fs.put_file(str(path), f"{url[5:]}/{path.name}")
    return url


@pytest.fixture
def s3_data(s3, s3_dataset) -> str:
    """s3_dataset's URL, for a test that reads it (with the server's variables: `s3`)."""
    return s3_dataset


@pytest.fixture
def cloud(s3, monkeypatch):
    """`cloud(delay_s, rate)`: the S3 server behind a shaper (tests/shaper.py: `delay_s` of
    latency per request, `rate` bytes/s per connection); its endpoint URL, which this test's
    AWS_ENDPOINT_URL then names (s3fs's cached clients dropped, as `s3` does)."""
    import s3fs

    from tests.shaper import Shaper

    made: list[Shaper] = []

    def make(delay_s: float, rate: float = 0.0) -> str:
        made.append(Shaper(s3.port, delay_s, rate))
        monkeypatch.setenv("AWS_ENDPOINT_URL", made[-1].endpoint)
        s3fs.S3FileSystem.clear_instance_cache()
        return made[-1].endpoint

    yield make
    s3fs.S3FileSystem.clear_instance_cache()
    for shaper in made:
        shaper.stop()

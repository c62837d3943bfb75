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


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> Path:
    """~90 KB of standard-library source as a byte-level dataset (2 val documents)."""
    out = tmp_path_factory.mktemp("data") / "tiny"
    prepare.run(PrepareConfig(sources=[str(STDLIB / f) for f in CORPUS], out=str(out),
                              tokenizer="byte", val_fraction=0.2))
    return out

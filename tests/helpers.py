"""Shared test helpers: small datasets written through the real shard and meta code."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from ddpgpt.data.prepare import SplitWriter, make_meta
from ddpgpt.data.shards import dtype_for_vocab

REPO = Path(__file__).resolve().parent.parent


def write_dataset(path: Path, train: np.ndarray, val: np.ndarray, vocab_size: int,
                  shard_tokens: int = 10**9, eot_id: int = 0) -> Path:
    """A dataset dir holding exactly these token streams (split into shards of `shard_tokens`)."""
    path.mkdir(parents=True, exist_ok=True)
    dtype = dtype_for_vocab(vocab_size)
    shards = {}
    for split, tokens in (("train", train), ("val", val)):
        writer = SplitWriter(path, split, dtype, shard_tokens)
        writer.write(np.asarray(tokens))
        shards[split] = writer.close()
    tok = SimpleNamespace(kind="byte", vocab_size=vocab_size, eot_id=eot_id)
    (path / "meta.json").write_text(json.dumps(make_meta(tok, dtype, shards, {"specs": ["test"]})))
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_cli(*args: str, timeout: float = 60, env: dict | None = None, cwd: Path | None = None):
    """Runs `python -m ddpgpt ARGS` and returns the CompletedProcess (text output)."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "ddpgpt", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, env=full_env, cwd=cwd)

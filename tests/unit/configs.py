"""Helpers of the config tests: a TOML file, the message a ConfigError says, `ddpgpt train ARGV`
parsed in process."""

from __future__ import annotations

import pytest

from ddpgpt import cli
from ddpgpt.config.checks import ConfigError
from ddpgpt.config.schema import TrainConfig


def _toml(tmp_path, text: str, name: str = "run.toml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def _error(fn, *args) -> str:
    with pytest.raises(ConfigError) as e:
        fn(*args)
    return str(e.value)


def _parse_train(argv: list[str]) -> TrainConfig:
    """The in-process twin of `ddpgpt train ARGV`: argparse -> nest -> build."""
    ns = cli._build_parser().parse_args(["train", *argv])
    return cli.train_config({k: v for k, v in vars(ns).items() if k not in ("command", "debug")})[0]

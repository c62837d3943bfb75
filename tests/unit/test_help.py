"""Help that teaches: one options heading per command, only true defaults, an example each, and
`train --help` short (the common flags) with --help-all for every flag."""

import argparse
import dataclasses
import re

import pytest

from ddpgpt import cli
from ddpgpt.config.schema import SECTIONS


def _help(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("command", ["train", *cli.COMMANDS])
def test_each_command_has_one_options_heading_true_defaults_and_an_example(command, capsys):
    text = _help([command, "--help"], capsys)
    assert text.count("\noptions:\n") == 1
    assert "(default: None)" not in text and "(default: [])" not in text
    assert "(default: False)" not in text
    assert re.search(r"\nexamples?:\n  (ddpgpt|torchrun) ", text)


def test_train_help_lists_the_common_flags_and_points_to_the_rest(capsys):
    short, every = _help(["train", "--help"], capsys), _help(["train", "--help-all"], capsys)
    fields = [f"--{s}.{f.name.replace('_', '-')}" for s, c in SECTIONS.items()
              for f in dataclasses.fields(c)]
    listed = [f for f in fields if re.search(rf"(^|[ ,]){re.escape(f)}[ ,\n]", short)]
    assert sorted(f[2:].replace("-", "_") for f in listed) == sorted(cli.TRAIN_LISTED)
    assert f"{len(fields) - len(listed)} more flags" in short
    assert all(re.search(rf"(^|[ ,]){re.escape(f)}[ ,\n]", every) for f in fields)
    assert len(short.splitlines()) < len(every.splitlines()) / 2


def test_an_unlisted_flag_works_all_the_same():
    ns = cli._build_parser().parse_args(["train", "--model.n-layer", "3", "--model.n_head", "2"])
    assert (vars(ns)["model.n_layer"], vars(ns)["model.n_head"]) == ("3", "2")


def test_the_top_level_help_speaks_to_users(capsys):
    text = " ".join(_help(["--help"], capsys).split())
    assert text.count("options:") == 1
    assert "Train GPT-style language models with data parallelism" in text
    assert "run(cfg)" not in text and "module" not in text
    assert all(f" {name} " in text for name in ["prepare", "train", *cli.COMMANDS])


def test_every_command_is_in_the_parser():
    sub = next(a for a in cli._build_parser()._actions
               if isinstance(a, argparse._SubParsersAction))
    assert list(sub.choices) == ["prepare", "train", *list(cli.COMMANDS)[1:]]

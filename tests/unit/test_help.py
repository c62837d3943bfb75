"""Help that teaches: one options heading per command, only true defaults, an example each,
`train --help` short (the common flags) with --help-all for every flag, and every field's
docstring (a preset's values as defaults) in it."""

import argparse
import dataclasses
import inspect
import re

import pytest

from ddpgpt import cli
from ddpgpt.config import commands, schema
from ddpgpt.config import model as model_config
from ddpgpt.config import optim as optim_config
from ddpgpt.config.io import field_docs
from ddpgpt.config.model import ModelConfig
from ddpgpt.config.schema import SECTIONS, DataConfig


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


def test_train_help_fits_120_lines_of_80_columns(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    assert len(_help(["train", "--help"], capsys).splitlines()) <= 120


def test_an_unlisted_flag_works_all_the_same():
    ns = cli._build_parser().parse_args(["train", "--model.n-layer", "3", "--model.n_head", "2"])
    assert (vars(ns)["model.n_layer"], vars(ns)["model.n_head"]) == ("3", "2")


def test_the_top_level_help_speaks_to_users(capsys):
    text = " ".join(_help(["--help"], capsys).split())
    assert text.count("options:") == 1
    assert "Train GPT-style language models with data parallelism" in text
    assert "run(cfg)" not in text and "module" not in text
    assert all(f" {name} " in text for name in ["prepare", "train", *cli.COMMANDS])


def test_ddpgpt_alone_shows_the_commands_and_version_says_the_version(capsys):
    """`ddpgpt` alone and `ddpgpt --version` are questions, not errors ("the following
    arguments are required: command")."""
    from ddpgpt import __version__

    cli.main([])
    assert capsys.readouterr().out == _help(["--help"], capsys)
    assert _help(["--version"], capsys) == f"ddpgpt {__version__}\n"


def test_every_command_is_in_the_parser():
    sub = next(a for a in cli._build_parser()._actions
               if isinstance(a, argparse._SubParsersAction))
    assert list(sub.choices) == ["prepare", "train", *list(cli.COMMANDS)[1:]]


# ---- field docstrings reach --help ------------------------------------------------------------

CONFIG_CLASSES = [c for module in (schema, model_config, optim_config, commands)
                  for _, c in inspect.getmembers(module, inspect.isclass)
                  if dataclasses.is_dataclass(c) and c.__module__ == module.__name__]


def test_field_docs():
    assert field_docs(ModelConfig)["n_layer"] == "Transformer blocks."
    assert field_docs(DataConfig)["global_batch"] == (
        "Sequences per optimizer step (G), fixed whatever the number of processes W; the "
        "accumulation steps are G / (W * b).")


def test_help_shows_field_docs_and_defaults():
    sub = next(a for a in cli._build_parser(every=True)._actions
               if isinstance(a, argparse._SubParsersAction))
    text = " ".join(sub.choices["train"].format_help().split())
    assert "--model.n-layer N_LAYER Transformer blocks. (default: 4)" in text
    assert ("--data DIR, --data.dir DIR Dataset directory made by `ddpgpt prepare`. "
            "(default: data/stdlib)" in text)


@pytest.mark.parametrize("cls", CONFIG_CLASSES, ids=lambda c: c.__name__)
def test_every_field_has_a_docstring(cls):
    docs = field_docs(cls)
    assert [f.name for f in dataclasses.fields(cls) if not docs.get(f.name)] == []


def test_meta_test_sees_every_config_class():
    assert {c.__name__ for c in CONFIG_CLASSES} >= {
        "PrepareConfig", "ModelConfig", "DataConfig", "OptimConfig", "RunConfig", "TrainConfig",
        "SampleConfig", "EvalConfig", "DoctorConfig", "PlotConfig", "ExportConfig", "BenchConfig",
        "RendezvousConfig"}


def test_help_shows_the_presets_values(capsys):
    """The dataclass defaults are lr 1e-3 and G = 32; tiny's are 2e-3 and 16."""
    with pytest.raises(SystemExit):
        cli.main(["train", "--preset", "tiny", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "Peak learning rate, reached after warmup_steps. (default: 0.002)" in text
    assert "the accumulation steps are G / (W * b). (default: 16)" in text


def test_init_from_help_names_every_family_the_weights_loader_reads():
    """--init-from (train's and eval's) reads GPT-2 and each Llama-family class hf/llama.py
    maps; its help names them all (it once left out Apertus)."""
    from ddpgpt.hf.llama import CLASSES

    families = ["GPT-2", *(name.removesuffix("ForCausalLM") for name in CLASSES.values())]
    for cls in (ModelConfig, commands.EvalConfig):
        doc = " ".join(field_docs(cls)["init_from"].split())
        assert [f for f in families if f not in doc] == [], cls.__name__

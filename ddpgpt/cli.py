"""The `ddpgpt` command line: each subcommand parses into a config and calls `<module>.run(cfg)`.

    ddpgpt prepare [SOURCE ...] --out DIR        corpus -> token shards        (data/prepare.py)
    ddpgpt train --data DIR [--preset tiny]      train, 1 process or --nproc N (train.py)
    ddpgpt sample --run DIR --prompt TEXT        generate from a checkpoint    (sample.py)
    ddpgpt eval --run DIR                        validation loss               (evaluate.py)
    ddpgpt doctor [--nproc N]                    environment and all-reduce probe (doctor.py)

Flags are generated from the config dataclasses, so `--help` shows each field's docstring. Bad
input (unknown flag, bad value, missing data) is one line on stderr and exit code 2; `--debug`
shows the traceback instead.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from ddpgpt.config import SECTIONS, PrepareConfig
from ddpgpt.errors import UserError
from ddpgpt.layering import base_type, coerce, field_docs, field_types


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is a UserError (one line) instead of usage text + exit."""

    def error(self, message):
        where = self.prog.removeprefix("ddpgpt").strip()
        raise UserError(f"{where + ': ' if where else ''}{message} (see --help)")


def add_fields(parser: argparse.ArgumentParser, cls: type, section: str | None = None) -> None:
    """One flag per dataclass field: `--name` or, in a section, `--section.name` (dashes or
    underscores). Values stay strings here and are checked by `coerce`, which names the field."""
    docs, types_ = field_docs(cls), field_types(cls)
    group = parser.add_argument_group(section or "options", (cls.__doc__ or "").strip())
    for f in dataclasses.fields(cls):
        dest = f"{section}.{f.name}" if section else f.name
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        kind = base_type(types_[f.name])
        help_ = f"{docs.get(f.name, '')} (default: {default})"
        if kind is list:  # the positional sources of `prepare`
            group.add_argument(dest, nargs="*", default=argparse.SUPPRESS, help=help_, metavar=f.name.upper().rstrip("S"))
            continue
        flags = [f"--{dest.replace('_', '-')}"] + ([f"--{dest}"] if "_" in f.name else [])
        if "alias" in f.metadata:
            flags.insert(0, f.metadata["alias"])
        if kind is bool:
            group.add_argument(*flags, dest=dest, action=argparse.BooleanOptionalAction,
                               default=argparse.SUPPRESS, help=help_)
        else:
            group.add_argument(*flags, dest=dest, default=argparse.SUPPRESS, help=help_,
                               metavar=f.name.upper())


def flat_config(cls: type, values: dict):
    """A flat config dataclass from parsed flag values, each coerced and named on error."""
    types_ = field_types(cls)
    return cls(**{k: coerce(v, types_[k], f"--{k.replace('_', '-')}", text=True) for k, v in values.items() if k in types_})


def train_overrides(values: dict) -> dict:
    """{"optim.lr": "3e-4"} -> {"optim": {"lr": "3e-4"}} for layering.apply."""
    nested: dict = {}
    for key, value in values.items():
        section, _, name = key.partition(".")
        if section in SECTIONS:
            nested.setdefault(section, {})[name] = value
    return nested


def _build_parser() -> argparse.ArgumentParser:
    from ddpgpt.config import DoctorConfig, EvalConfig, SampleConfig

    parser = _Parser(prog="ddpgpt", description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser("prepare", help="turn a corpus into token shards", allow_abbrev=False,
                       description="Turn a text corpus into token shards (see README: Data).")
    add_fields(p, PrepareConfig)

    t = sub.add_parser("train", help="train a model (one process, --nproc N, or under torchrun)",
                       allow_abbrev=False, description="Train a GPT with data parallelism (see README).")
    t.add_argument("--preset", help="named config: tiny, small, gpt2-124m, gpt2-350m")
    t.add_argument("--config", help="TOML file with [model] [data] [optim] [run] sections")
    t.add_argument("--nproc", type=int, help="start N local processes through torch's elastic launcher")
    t.add_argument("--max-restarts", type=int, default=0,
                   help="with --nproc: restart the whole group up to K times after a worker dies; "
                        "each restart resumes from the latest complete checkpoint")
    t.add_argument("--reset", action="store_true",
                   help="set the run dir's checkpoints and metrics aside (into reset-<time>/) and start over; "
                        "same as --resume reset")
    for section, cls in SECTIONS.items():
        add_fields(t, cls, section)

    for name, cls, help_ in (("sample", SampleConfig, "generate text from a run's latest checkpoint"),
                             ("eval", EvalConfig, "print a run's validation loss"),
                             ("doctor", DoctorConfig, "print the environment; probe all-reduce bandwidth")):
        add_fields(sub.add_parser(name, help=help_, description=help_, allow_abbrev=False), cls)
    return parser


def _values(ns: argparse.Namespace) -> dict:
    return {k: v for k, v in vars(ns).items() if k not in ("command", "debug")}


def dispatch(argv: list[str]) -> None:
    ns = _build_parser().parse_args(argv)
    values = _values(ns)
    if ns.command == "prepare":
        from ddpgpt.data import prepare
        prepare.run(flat_config(PrepareConfig, values))
    elif ns.command == "train":
        from ddpgpt.layering import resolve
        launch = {k: values.pop(k, None) for k in ("preset", "config", "nproc", "max_restarts", "reset")}
        if launch["reset"]:
            values["run.resume"] = "reset"
        cfg = resolve(launch["preset"], launch["config"], train_overrides(values))  # before torch loads
        from ddpgpt import train
        train.main(cfg, launch["nproc"], launch["max_restarts"], argv)
    elif ns.command == "sample":
        from ddpgpt import sample
        from ddpgpt.config import SampleConfig
        sample.run(flat_config(SampleConfig, values))
    elif ns.command == "eval":
        from ddpgpt import evaluate
        from ddpgpt.config import EvalConfig
        evaluate.run(flat_config(EvalConfig, values))
    elif ns.command == "doctor":
        from ddpgpt import doctor
        from ddpgpt.config import DoctorConfig
        doctor.run(flat_config(DoctorConfig, values), argv)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    debug = "--debug" in argv or os.environ.get("DDPGPT_DEBUG") == "1"
    try:
        dispatch([a for a in argv if a != "--debug"])
    except UserError as e:
        if debug:
            raise
        if not e.quiet:  # a quiet error was reported by another rank; this one only exits
            print(f"ddpgpt: {e.label}: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        print("ddpgpt: interrupted", file=sys.stderr)
        sys.exit(130)

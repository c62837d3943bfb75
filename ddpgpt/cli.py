"""The `ddpgpt` command line: each subcommand parses into a config and calls `<module>.run(cfg)`
(COMMANDS: one row per command, each run(cfg) in commands/ but prepare's, in data/prepare/main.py;
train has its own flags, built from the config's sections, and `--nproc` goes to run/launch.py).

    ddpgpt prepare [SOURCE ...] --out DIR          corpus -> token shards
    ddpgpt train --data DIR [--preset tiny]        train, 1 process or --nproc N
    ddpgpt sample --run-dir DIR --prompt TEXT      generate from a checkpoint
    ddpgpt chat --run-dir DIR                      talk with a fine-tuned model
    ddpgpt eval --run-dir DIR                      validation loss
    ddpgpt doctor [--nproc N]                      environment and all-reduce probe
    ddpgpt bench [--nproc N] [--sync MODES]        what each sync mode costs
    ddpgpt plot RUN [RUN ...] [--out FILE.png]     loss curves and tokens/s of runs
    ddpgpt export --run-dir DIR --out DIR          a checkpoint for transformers
    ddpgpt rendezvous [--port 29500]               elastic jobs' rendezvous store
    ddpgpt check [--device cuda] [--quick]         every path against its oracle

Flags are generated from the config dataclasses (config/io.py), so `--help` shows each field's
docstring. Bad input (unknown flag, bad value, missing data) is one line on stderr and exit code
2; `--debug` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import sys
from pathlib import Path

from ddpgpt import __version__
from ddpgpt.config.commands import (
    BenchConfig,
    ChatConfig,
    CheckConfig,
    DoctorConfig,
    EvalConfig,
    ExportConfig,
    PlotConfig,
    PrepareConfig,
    RendezvousConfig,
    SampleConfig,
)
from ddpgpt.config.io import add_flags, build, continued, flat_config, nest
from ddpgpt.config.schema import SECTIONS, RunConfig, TrainConfig
from ddpgpt.errors import UserError, did_you_mean, survive_closed_output

# What other trainers call some of our flags (nanoGPT's, transformers' Trainer's): a name typed
# from habit is answered with ours.
OTHER_NAMES = {"learning-rate": "lr", "max-iters": "steps", "max-steps": "steps",
               "batch-size": "global-batch", "n-layers": "n-layer", "n-heads": "n-head",
               "warmup-iters": "warmup-steps", "out-dir": "run-dir"}


class _Formatter(argparse.HelpFormatter):
    """argparse's, except that a text of several lines (the examples) keeps its lines."""

    def _fill_text(self, text, width, indent):
        if "\n" in text:
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is a UserError (one line) instead of usage text + exit, and a
    mistyped flag is answered with the closest one the command has."""

    def error(self, message, hint: str = ""):
        where = self.prog.removeprefix("ddpgpt").strip()
        raise UserError(f"{where + ': ' if where else ''}{message}{hint or ' (see --help)'}")

    def parse_args(self, args=None, namespace=None):
        ns, extras = self.parse_known_args(args, namespace)
        if extras:
            flag = next((a.split("=")[0] for a in extras if a.startswith("--")), "")
            self.error(f"unrecognized arguments: {' '.join(extras)}",
                       closest_flag(subparser(self, getattr(ns, "command", None)) or self,
                                    flag))
        return ns


def subparser(parser: argparse.ArgumentParser, command: str | None):
    """The parser of `command` under `parser`, or None."""
    return next((a.choices.get(command) for a in parser._actions
                 if isinstance(a, argparse._SubParsersAction)), None)


def closest_flag(parser: argparse.ArgumentParser, flag: str) -> str:
    """" (did you mean --x?)" for a flag `parser` does not have (dashes and underscores alike, in
    its section first, other trainers' names too), or ""."""
    if not flag:
        return ""
    flags = [o for a in parser._actions for o in a.option_strings
             if o.startswith("--") and "_" not in o]  # each flag's dashed spelling
    typed = flag.replace("_", "-")
    section, _, name = typed[2:].rpartition(".")
    # another trainer's name, or ours without its section or in another one; in the section
    # typed first
    for ours in filter(None, (OTHER_NAMES.get(name), name)):
        named = [f for f in flags if f.endswith("." + ours) or f == "--" + ours]
        named = [f for f in named if f.startswith(f"--{section}.")] or named
        if named:
            return f" (did you mean {' or '.join(named)}?)"
    return did_you_mean(typed, flags)


# Every command but train: its settings (config/commands.py), where its run(cfg) lives (imported
# only when it runs, so that a bad flag is one line before torch loads), and its one line of help.
COMMANDS = {
    "prepare": (PrepareConfig, "ddpgpt.data.prepare.main:run",
                "turn a corpus into token shards (docs/usage.md: Data)",
                "ddpgpt prepare 'books/*.txt' --tokenizer bpe --out data/books"),
    "sample": (SampleConfig, "ddpgpt.commands.sample:run",
               "generate text from a run's latest checkpoint",
               "ddpgpt sample --run-dir runs/demo --prompt 'def ' --temperature 0"),
    "eval": (EvalConfig, "ddpgpt.commands.eval:run", "print a run's validation loss",
             "ddpgpt eval --run-dir runs/demo"),
    "doctor": (DoctorConfig, "ddpgpt.commands.doctor:run",
               "print the environment; probe all-reduce bandwidth",
               "ddpgpt doctor --nproc 2"),
    "bench": (BenchConfig, "ddpgpt.commands.bench:run",
              "measure each gradient-sync mode: time, bytes, memory",
              "ddpgpt bench --nproc 2 --sync ddp,zero1"),
    "plot": (PlotConfig, "ddpgpt.commands.plot:run",
             "draw runs' loss curves and tokens/s into one PNG",
             "ddpgpt plot runs/adamw runs/muon --out curves.png"),
    "chat": (ChatConfig, "ddpgpt.commands.chat:run",
             "talk with a model fine-tuned on conversations (docs/chat.md)",
             "ddpgpt chat --run-dir runs/sft --system 'Answer in one line.'"),
    "export": (ExportConfig, "ddpgpt.commands.export:run",
               "write a checkpoint as a Hugging Face transformers directory",
               "ddpgpt export --run-dir runs/demo --out exported/demo"),
    "check": (CheckConfig, "ddpgpt.commands.check.main:run",
              "check every path against its oracle on this machine's device; writes "
              "device-check.md", "ddpgpt check --device cuda --out device-check"),
    "rendezvous": (RendezvousConfig, "ddpgpt.commands.rendezvous:run",
                   "host the rendezvous store of elastic jobs (torchrun --nnodes MIN:MAX) on a "
                   "node that does not train", "ddpgpt rendezvous --port 29500"),
}

# What `train --help` lists; --help-all lists every flag (each works either way).
# (At most 120 lines at 80 columns: the tasks, the target loss and the trackers are in
# --help-all and docs/gpt2.md.)
TRAIN_LISTED = {"data.dir", "run.dir", "run.steps", "run.device", "run.resume", "run.sync",
                "run.precision", "run.compile", "run.eval_every", "run.checkpoint_every",
                "run.seed", "optim.name", "optim.lr", "optim.schedule",
                "data.global_batch", "data.micro_batch", "model.init_from"}
TRAIN_EXAMPLES = """examples:
  ddpgpt train --data data/stdlib --preset tiny --nproc 2
  ddpgpt train --data data/a:0.7,data/b:0.3 ...   # a mixture (docs/usage.md, Mixtures)
  torchrun --nproc_per_node 8 -m ddpgpt train --data data/fineweb --preset gpt2-124m
  ddpgpt train --preset tiny --print-config      # the whole config, every value resolved"""

TRAIN_OPTIONS = ("preset", "config", "nproc", "max_restarts", "reset", "resolved_config",
                 "print_config")


def _build_parser(shown: TrainConfig | None = None, every: bool = False
                  ) -> argparse.ArgumentParser:
    """`shown`: the config whose values `train --help` lists as defaults (a preset's). `every`:
    `train --help` lists every flag (--help-all), not only TRAIN_LISTED."""
    parser = _Parser(prog="ddpgpt", allow_abbrev=False,
                     description="Train GPT-style language models with data parallelism: one CPU "
                     "process, N local processes (--nproc), or many nodes under torchrun. "
                     "Start with `ddpgpt prepare`, then `ddpgpt train` (docs/usage.md).")
    parser.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    parser.add_argument("--version", action="version", version=f"ddpgpt {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    for name, (cls, _, help_, example) in COMMANDS.items():
        if name == "sample":  # train's place: after prepare
            _add_train(sub, shown, every)
        add_flags(sub.add_parser(name, help=help_, description=help_, allow_abbrev=False,
                                 epilog=f"example:\n  {example}", formatter_class=_Formatter),
                  cls)
    return parser


def _add_train(sub, shown: TrainConfig | None, every: bool) -> None:
    hidden = sum(f"{section}.{f.name}" not in TRAIN_LISTED for section, cls in SECTIONS.items()
                 for f in dataclasses.fields(cls))
    t = sub.add_parser("train", help="train a model (one process, --nproc N, or under torchrun)",
                       allow_abbrev=False, formatter_class=_Formatter,
                       usage="ddpgpt train [--data DIR] [--preset NAME] [--nproc N] [FLAG ...]",
                       description="Train a GPT with data parallelism (docs/usage.md). In a "
                       "run dir that has a config.json, without --preset or --config, the run "
                       "goes on with its own settings; flags override them.",
                       epilog=TRAIN_EXAMPLES + ("" if every else f"\n\n{hidden} more flags "
                                                "(model shape, data, optimizer, run): "
                                                "ddpgpt train --help-all"))
    t.add_argument("--help-all", action="store_true", help="list every flag, then exit")
    t.add_argument("--preset", metavar="NAME",
                   help="named config: tiny, speedrun, small, gpt2-124m, gpt2-350m")
    t.add_argument("--config", metavar="TOML",
                   help="a file with [model] [data] [optim] [run] sections")
    t.add_argument("--nproc", type=int, metavar="N",
                   help="start N local processes (torch's elastic launcher)")
    t.add_argument("--max-restarts", type=int, metavar="K",
                   help="with --nproc: restart the group up to K times after a worker dies")
    t.add_argument("--reset", action="store_true",
                   help="set the run dir's checkpoints aside (reset-<time>/) and start over")
    t.add_argument("--resolved-config", metavar="CONFIG_JSON",
                   help="start from a run's config.json; flags override it")
    t.add_argument("--print-config", action="store_true",
                   help="print the config, every `auto` resolved, as TOML for --config; exit")
    for section, cls in SECTIONS.items():
        add_flags(t, cls, section, getattr(shown, section) if shown else None,
                  listed=None if every else TRAIN_LISTED.__contains__)


def train_config(values: dict) -> tuple[TrainConfig, int | None, int, str]:
    """(the config, --nproc, --max-restarts, the lines to say once it checked out) from the
    parsed `train` flags: preset -> --config file -> flags; or, for a run dir that has a
    config.json and neither a preset nor a file, that config -> flags (the run continues as it
    was made: `--run-dir R` without --data also on the processes it last trained on, unless
    --nproc says otherwise); or --resolved-config FILE -> flags."""
    options = {k: values.pop(k, None) for k in TRAIN_OPTIONS}
    nproc, continuing, saved_world = options["nproc"], False, None
    if options["reset"]:
        if values.get("run.resume") not in (None, "reset"):
            raise UserError(f"--reset and --resume {values['run.resume']} contradict each "
                            "other; give one")
        values["run.resume"] = "reset"
    flags, whole = nest(values), options["preset"] or options["config"]
    if options["resolved_config"]:
        if whole:
            given = "--preset" if options["preset"] else "--config"
            raise UserError(f"--resolved-config is a whole config; {given} does not go with it: "
                            "give one of them (flags override either)")
        base = continued(read_config(options["resolved_config"], "--resolved-config"), flags,
                         options["resolved_config"])
    else:
        run_dir = Path(values.get("run.dir") or RunConfig().dir)
        saved = run_dir / "config.json"
        continuing = "run.dir" in values and "data.dir" not in values and not whole
        url = values.get("run.checkpoint_url")
        if url:  # read below, before the preflight checks it: a typo is one line
            from ddpgpt.checkpoint.location import check_url
            check_url(url)
        if continuing and not url:  # (with a URL, the run may be there: _from_checkpoints)
            from ddpgpt.run.run_dir import check_continues
            check_continues(values["run.dir"])  # `--run-dir R` without --data continues R
        base = None if whole or not saved.is_file() else continued(
            read_config(saved, "the run's config", "; restore it, or give the whole config "
                        "(--preset, --config)"), flags, str(saved))
        if base is None and not whole and url:
            base, saved_world = _from_checkpoints(url, flags)
    from ddpgpt.run.init_weights import Shape
    shape = Shape()
    cfg = build(options["preset"], options["config"], flags, shape=shape, base=base)
    notes = shape.note(cfg)
    if base is not None and nproc is None and not options["resolved_config"]:
        from ddpgpt.run.launch import continuing_nproc
        nproc, note = continuing_nproc(run_dir, cfg.run.device, continuing, saved_world)
        notes += [note] if note else []
    if options["print_config"]:
        from ddpgpt.run.preflight import print_config
        print_config(cfg, nproc)
        sys.exit(0)
    return cfg, nproc, options["max_restarts"] or 0, "\n".join(notes)


def _from_checkpoints(url: str, flags: dict) -> tuple[TrainConfig | None, int | None]:
    """A run dir without a config.json and checkpoints at a URL: the config of the newest
    complete checkpoint there and the processes that saved it (a start on another machine goes
    on as the run was made, on as many); (None, None) when there is none yet (a first start)."""
    from ddpgpt.checkpoint.read import newest_meta

    found = newest_meta(url)
    return (continued(found[0]["config"], flags, found[1]), found[0].get("world_size")) \
        if found else (None, None)


def read_config(path: str | Path, where: str, fix: str = "") -> dict:
    """A config.json's values, or one line naming `where` it came from."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise UserError(f"{where} {path}: cannot read it ({e.strerror}){fix}") from None
    try:
        return json.loads(text)
    except ValueError as e:
        raise UserError(f"{where} {path}: not valid JSON ({e}){fix}") from None


TRUE, FALSE = ("true", "yes", "1"), ("false", "no", "0")


def bool_values(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """`--model.bias false` and `--model.bias=false` (what a config file's `bias = false` reads
    like) as `--no-model.bias`; `true` as the bare flag. argparse's boolean flags take no value
    and would report only "unrecognized arguments: false"."""
    sub = subparser(parser, argv[0]) if argv else None
    if sub is None:
        return argv
    negative = {}
    for action in sub._actions:
        if isinstance(action, argparse.BooleanOptionalAction):
            positive = [o for o in action.option_strings if not o.startswith("--no-")]
            for flag in positive:
                negative[flag] = "--no-" + positive[-1][2:]
    out, i = [], 0
    while i < len(argv):
        flag, eq, value = argv[i].partition("=")
        if flag in negative and not eq and i + 1 < len(argv):
            value = argv[i + 1]
            eq = value.lower() in TRUE + FALSE
            i += eq
        if flag in negative and eq:
            if value.lower() not in TRUE + FALSE:
                raise UserError(f"{flag}: expected true or false, got {value!r} (or write "
                                f"{flag} / {negative[flag]})")
            out.append(flag if value.lower() in TRUE else negative[flag])
        else:
            out.append(argv[i])
        i += 1
    return out


def help_defaults(argv: list[str]) -> TrainConfig | None:
    """`train --preset tiny --help` lists the preset's values (and a --config file's) as the
    defaults, not the dataclasses'."""
    if argv[:1] != ["train"] or not {"-h", "--help"} & set(argv):
        return None
    found = {}
    for i, arg in enumerate(argv):
        for name in ("--preset", "--config"):
            if arg == name and i + 1 < len(argv):
                found[name] = argv[i + 1]
            elif arg.startswith(name + "="):
                found[name] = arg.split("=", 1)[1]
    if not found:
        return None
    return build(found.get("--preset"), found.get("--config"), {})


def check_command(argv: list[str]) -> None:
    """A mistyped command as one line with the one meant (argparse says only "invalid choice")."""
    names = ["prepare", "train", *(c for c in COMMANDS if c != "prepare")]
    if argv and not argv[0].startswith("-") and argv[0] not in names:
        raise UserError(f"unknown command {argv[0]!r}{did_you_mean(argv[0], names)}; the "
                        f"commands: {', '.join(names)} (ddpgpt --help)")


def dispatch(argv: list[str]) -> None:
    if not argv:  # what there is to do, rather than "the following arguments are required"
        _build_parser().print_help()
        return
    check_command(argv)
    every = argv[:1] == ["train"] and "--help-all" in argv
    if every:
        argv = [a if a != "--help-all" else "--help" for a in argv]
    parser = _build_parser(help_defaults(argv), every)
    ns = parser.parse_args(bool_values(parser, argv))
    values = {k: v for k, v in vars(ns).items() if k not in ("command", "debug", "help_all")}
    if ns.command == "train":
        cfg, nproc, max_restarts, note = train_config(values)  # checked before torch loads
        if nproc is None:
            from ddpgpt.commands import train
            train.run(cfg, note)
        else:
            from ddpgpt.run import launch
            sys.exit(launch.train(cfg, nproc, max_restarts, note))
        return
    cls, target, _, _ = COMMANDS[ns.command]
    module, function = target.split(":")
    getattr(importlib.import_module(module), function)(flat_config(cls, values))


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    survive_closed_output()
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

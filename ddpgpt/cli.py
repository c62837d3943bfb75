"""The `ddpgpt` command line: each subcommand parses into a config and calls `<module>.run(cfg)`.

    ddpgpt prepare [SOURCE ...] --out DIR          corpus -> token shards        (data/prepare.py)
    ddpgpt train --data DIR [--preset tiny]        train, 1 process or --nproc N (train.py,
                                                                                  launch.py)
    ddpgpt sample --run-dir DIR --prompt TEXT      generate from a checkpoint    (sample.py)
    ddpgpt eval --run-dir DIR                      validation loss               (evaluate.py)
    ddpgpt doctor [--nproc N]                      environment and all-reduce probe (doctor.py)
    ddpgpt bench [--nproc N] [--sync MODES]        what each sync mode costs (bench.py)
    ddpgpt plot RUN [RUN ...] [--out FILE.png]     loss curves and tokens/s of runs (plot.py)
    ddpgpt export --run-dir DIR --out DIR          a checkpoint for transformers (export.py)
    ddpgpt rendezvous [--port 29500]               host elastic jobs' rendezvous store (dist.py)
    ddpgpt check [--device cuda] [--quick]         every path against its oracle (check/)

Flags are generated from the config dataclasses (config_io.py), so `--help` shows each field's
docstring. Bad input (unknown flag, bad value, missing data) is one line on stderr and exit code
2; `--debug` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from ddpgpt.config.commands import (
    BenchConfig,
    CheckConfig,
    DoctorConfig,
    EvalConfig,
    ExportConfig,
    PlotConfig,
    PrepareConfig,
    RendezvousConfig,
    SampleConfig,
)
from ddpgpt.config.io import add_flags, build, flat_config, from_dict, nest
from ddpgpt.config.schema import SECTIONS, TrainConfig
from ddpgpt.errors import UserError, survive_closed_output


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is a UserError (one line) instead of usage text + exit."""

    def error(self, message):
        where = self.prog.removeprefix("ddpgpt").strip()
        raise UserError(f"{where + ': ' if where else ''}{message} (see --help)")


TRAIN_OPTIONS = ("preset", "config", "nproc", "max_restarts", "reset", "resolved_config",
                 "print_config")


def _build_parser(shown: TrainConfig | None = None) -> argparse.ArgumentParser:
    """`shown`: the config whose values `train --help` lists as defaults (a preset's)."""
    parser = _Parser(prog="ddpgpt", description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser("prepare", help="turn a corpus into token shards", allow_abbrev=False,
                       description="Turn a text corpus into token shards (docs/usage.md: Data).")
    add_flags(p, PrepareConfig)

    t = sub.add_parser("train", help="train a model (one process, --nproc N, or under torchrun)",
                       allow_abbrev=False,
                       description="Train a GPT with data parallelism (docs/usage.md).")
    t.add_argument("--preset", help="named config: tiny, small, gpt2-124m, gpt2-350m")
    t.add_argument("--config", help="TOML file with [model] [data] [optim] [run] sections")
    t.add_argument("--nproc", type=int,
                   help="start N local processes through torch's elastic launcher")
    t.add_argument("--max-restarts", type=int,
                   help="with --nproc: restart the whole group up to K times after a worker dies; "
                        "each restart resumes from the latest complete checkpoint (default: 0)")
    t.add_argument("--reset", action="store_true",
                   help="set the run dir's checkpoints and metrics aside (into reset-<time>/) and "
                        "start over; same as --resume reset")
    t.add_argument("--resolved-config", metavar="CONFIG_JSON",
                   help="start from a run's resolved config.json and nothing else (what --nproc "
                        "workers do)")
    t.add_argument("--print-config", action="store_true",
                   help="print the config this command would train with, every `auto` resolved "
                        "(for the dataset, --nproc and the run dir's checkpoint), as TOML that "
                        "--config reads; then exit")
    for section, cls in SECTIONS.items():
        add_flags(t, cls, section, getattr(shown, section) if shown else None)

    for name, cls, help_ in (("sample", SampleConfig,
                              "generate text from a run's latest checkpoint"),
                             ("eval", EvalConfig, "print a run's validation loss"),
                             ("doctor", DoctorConfig,
                              "print the environment; probe all-reduce bandwidth"),
                             ("bench", BenchConfig,
                              "measure each gradient-sync mode: time, bytes, memory"),
                             ("plot", PlotConfig,
                              "draw runs' loss curves and tokens/s into one PNG"),
                             ("export", ExportConfig,
                              "write a checkpoint as a Hugging Face transformers directory"),
                             ("check", CheckConfig,
                              "check every path against its oracle on this machine's device; "
                              "writes device-check.md"),
                             ("rendezvous", RendezvousConfig,
                              "host the rendezvous store of elastic jobs (torchrun --nnodes "
                              "MIN:MAX) on a node that does not train")):
        add_flags(sub.add_parser(name, help=help_, description=help_, allow_abbrev=False), cls)
    return parser


def train_config(values: dict) -> tuple[TrainConfig, int | None, int]:
    """(the config, --nproc, --max-restarts) from the parsed `train` flags."""
    options = {k: values.pop(k, None) for k in TRAIN_OPTIONS}
    if options["resolved_config"]:
        others = [k for k, v in options.items()
                  if v and k not in ("resolved_config", "nproc", "max_restarts")]
        if values or others:
            flags = ", ".join(f"--{k.replace('_', '-')}" for k in [*others, *values])
            raise UserError(f"--resolved-config takes no config flags beside it (got {flags}); "
                            "edit the file, or build the config from flags instead")
        path = options["resolved_config"]
        try:
            text = open(path).read()
        except OSError as e:
            raise UserError(f"--resolved-config {path}: cannot read it ({e.strerror})") from None
        try:
            values_json = json.loads(text)
        except ValueError as e:
            raise UserError(f"--resolved-config {path}: not valid JSON ({e})") from None
        cfg = from_dict(values_json, source=path)
    else:
        if options["reset"]:
            if values.get("run.resume") not in (None, "reset"):
                raise UserError(f"--reset and --resume {values['run.resume']} contradict each "
                                "other; give one")
            values["run.resume"] = "reset"
        cfg = build(options["preset"], options["config"], nest(values))
    if options["print_config"]:
        print_config(cfg, options["nproc"])
        sys.exit(0)
    return cfg, options["nproc"], options["max_restarts"] or 0


def print_config(cfg: TrainConfig, nproc: int | None) -> None:
    """What `train` would run with, as TOML. Every `auto` is resolved as the run would resolve
    it; without the dataset, the values that depend on it stay as given, and a comment says so."""
    from ddpgpt import dist
    from ddpgpt.config.io import to_toml
    from ddpgpt.errors import DataError
    from ddpgpt.run import resume
    from ddpgpt.run.preflight import preflight
    from ddpgpt.run.run_dir import RunDir

    here = dist.detect()
    world = nproc or here.world_size
    try:
        cfg, dataset = preflight(cfg, world, nproc or here.local_world_size)
    except DataError as e:
        print(f"# not resolved (model.vocab_size, data.seq_len, run.*: auto): {e}")
    else:
        start = resume.choose(cfg, RunDir(cfg.run.dir), True, dataset.fingerprint, verify=False,
                              tokenizer=dataset.tokenizer_fingerprint)
        cfg = resume.settle(cfg, start)
        where = f"resuming {start.path}" if start.path else "from scratch"
        print(f"# resolved for {world} process{'es' if world > 1 else ''}, {where}")
    print(to_toml(cfg), end="")


TRUE, FALSE = ("true", "yes", "1"), ("false", "no", "0")


def bool_values(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """`--model.bias false` and `--model.bias=false` (what a config file's `bias = false` reads
    like) as `--no-model.bias`; `true` as the bare flag. argparse's boolean flags take no value
    and would report only "unrecognized arguments: false"."""
    sub = next((a.choices.get(argv[0]) for a in parser._actions
                if isinstance(a, argparse._SubParsersAction) and argv), None)
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


def dispatch(argv: list[str]) -> None:
    parser = _build_parser(help_defaults(argv))
    ns = parser.parse_args(bool_values(parser, argv))
    values = {k: v for k, v in vars(ns).items() if k not in ("command", "debug")}
    if ns.command == "prepare":
        from ddpgpt.data import prepare
        prepare.run(flat_config(PrepareConfig, values))
    elif ns.command == "train":
        cfg, nproc, max_restarts = train_config(values)  # checked before torch loads
        if nproc is None:
            from ddpgpt import train
            train.run(cfg)
        else:
            from ddpgpt.run import launch
            sys.exit(launch.train(cfg, nproc, max_restarts))
    elif ns.command == "sample":
        from ddpgpt import sample
        sample.run(flat_config(SampleConfig, values))
    elif ns.command == "eval":
        from ddpgpt import evaluate
        evaluate.run(flat_config(EvalConfig, values))
    elif ns.command == "bench":
        from ddpgpt import bench
        bench.run(flat_config(BenchConfig, values))
    elif ns.command == "plot":
        from ddpgpt import plot
        plot.run(flat_config(PlotConfig, values))
    elif ns.command == "export":
        from ddpgpt import export
        export.run(flat_config(ExportConfig, values))
    elif ns.command == "rendezvous":
        rendezvous(flat_config(RendezvousConfig, values))
    elif ns.command == "check":
        from ddpgpt import check
        check.run(flat_config(CheckConfig, values))
    elif ns.command == "doctor":
        from ddpgpt import doctor
        doctor.run(flat_config(DoctorConfig, values))


def rendezvous(cfg: RendezvousConfig) -> None:
    """Serves until stopped (Ctrl-C, SIGTERM); prints how the nodes reach it."""
    import socket

    from ddpgpt import dist

    where = f"{socket.getfqdn()}:{cfg.port}"
    dist.serve_store(cfg.host, cfg.port, ready=lambda: print(
        f"ddpgpt: rendezvous store on {cfg.host}:{cfg.port}; start every node with "
        f"--rdzv-backend c10d --rdzv-endpoint {where} --rdzv-conf is_host=0; Ctrl-C ends it",
        file=sys.stderr, flush=True))


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

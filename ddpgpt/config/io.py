"""Configs in and out of text: command-line flags, TOML files and config.json.

    build("tiny", "run.toml", {"optim": {"lr": "3e-4"}})   # preset -> TOML file -> flags
    from_dict(json.loads(path.read_text()))                 # a run's config.json, a checkpoint's

A TOML file has sections [model] [data] [optim] [run] and an optional top-level `preset`. Flag
values arrive as strings and are parsed into the field's type; TOML and JSON values must already
have it ("4" is a string there, not an integer). Each layer is validated as it is applied, and an
error names its source (the file, or "command line") and the field.

The flags themselves are generated from the dataclasses (`add_flags`): `--section.name` with
dashes or underscores, `--no-section.name` for booleans, a field's `alias` metadata as a short
form, and the docstring written under each field as its `--help` text.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import json
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

from ddpgpt.config.checks import ConfigError
from ddpgpt.config.schema import SECTIONS, TrainConfig

TYPE_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string",
              list: "a list"}


# ---- fields -----------------------------------------------------------------------------------

@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The docstring written under each field of a dataclass (what `--help` shows); empty when
    the package is installed without its sources."""
    try:
        tree = ast.parse(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)):
            docs[node.target.id] = " ".join(str(nxt.value.value).split())
    return docs


def field_types(cls: type) -> dict[str, Any]:
    hints = get_type_hints(cls, vars(sys.modules[cls.__module__]))
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def base_type(tp: Any) -> Any:
    """`str | None` -> str; `list[str]` -> list; a Literal of choices -> their type (str); plain
    types unchanged."""
    if get_origin(tp) in (Union, types.UnionType):
        return base_type(next(a for a in get_args(tp) if a is not type(None)))
    if get_origin(tp) is Literal:
        return type(get_args(tp)[0])
    return get_origin(tp) or tp


# ---- values -----------------------------------------------------------------------------------

def parse_text(value: str, tp: Any, where: str) -> Any:
    """A command-line string as the field's type."""
    kind = base_type(tp)
    if kind in (str, list) or not isinstance(value, str):
        return value
    try:
        if kind is bool:
            if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError
            return value.lower() in ("true", "1", "yes")
        return kind(value)
    except ValueError:
        raise ConfigError(f"{where}: expected {TYPE_NAMES[kind]}, got {value!r}") from None


def check_type(value: Any, tp: Any, where: str) -> Any:
    """A typed value (TOML, JSON) that must already have the field's type; an int is accepted
    for a float."""
    kind = base_type(tp)
    if value is None and type(None) in get_args(tp):
        return None
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, kind) or (kind in (int, float) and isinstance(value, bool)):
        raise ConfigError(f"{where}: expected {TYPE_NAMES[kind]}, got {value!r} "
                          f"({type(value).__name__})")
    return value


def overlay(cfg: TrainConfig, values: dict, source: str,
            convert: Callable = check_type) -> TrainConfig:
    """A copy of `cfg` with the nested `values` ({section: {field: value}}) applied, each value
    passed through `convert` (check_type or parse_text) and every section validated."""
    sections = {}
    for section, fields in values.items():
        if section not in SECTIONS:
            raise ConfigError(f"{source}: unknown section [{section}]; known: "
                              f"{', '.join(SECTIONS)}")
        if not isinstance(fields, dict):
            raise ConfigError(f"{source}: [{section}] must be a table of fields, got {fields!r}")
        current = getattr(cfg, section)
        types_ = field_types(type(current))
        changes = {}
        for name, value in fields.items():
            if name not in types_:
                raise ConfigError(f"{source}: unknown key {section}.{name}; known: "
                                  f"{', '.join(types_)}")
            changes[name] = convert(value, types_[name], f"{source}: {section}.{name}")
        sections[section] = _replace(current, changes, source)
    return _replace(cfg, sections, source)


def _replace(obj, changes: dict, source: str):
    """dataclasses.replace; a validation error (__post_init__) names the file it came from."""
    try:
        return dataclasses.replace(obj, **changes)
    except ConfigError as e:
        if source == "command line":
            raise
        raise ConfigError(f"{source}: {e}") from None


# ---- sources ----------------------------------------------------------------------------------

def load_toml(path: str | Path) -> dict:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} not found") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML ({e})") from None


def sources_table(data: dict, path) -> dict:
    """A TOML file's [[data.sources]] tables ({dir = "...", weight = 0.7} each) as data.dir's
    mixture text (DIR:WEIGHT,...): one form for the flag, the file and config.json."""
    tables, data = data["sources"], {k: v for k, v in data.items() if k != "sources"}
    fix = 'write [[data.sources]] tables, each with dir = "DIR" and weight = NUMBER'
    if "dir" in data:
        raise ConfigError(f"{path}: data.dir and [[data.sources]] both name the data; keep one")
    if not isinstance(tables, list) or not tables:
        raise ConfigError(f"{path}: data.sources must be a list of tables; {fix}")
    parts = []
    for i, table in enumerate(tables):
        ok = isinstance(table, dict) and isinstance(table.get("dir"), str) and \
            set(table) <= {"dir", "weight"}
        weight = table.get("weight", 1.0) if ok else None
        if not ok or isinstance(weight, bool) or not isinstance(weight, (int, float)):
            raise ConfigError(f"{path}: data.sources[{i}] = {table!r}; {fix}")
        if "," in table["dir"]:
            raise ConfigError(f"{path}: data.sources[{i}].dir = {table['dir']!r} holds a comma, "
                              "which a mixture cannot name; rename the directory")
        parts.append(f"{table['dir']}:{weight!r}")
    return {**data, "dir": ",".join(parts)}


# What configs written by earlier versions hold that this one names otherwise: a retired key is
# dropped (None), a retired value becomes its successor. Only for saved configs, never for input.
RETIRED = {("run", "rollback_lr_steps"): None,  # rollbacks now lower the lr for good
           ("run", "on_spike"): {"rollback": "recover"}}


def from_dict(values: dict, source: str = "config.json") -> TrainConfig:
    """Rebuilds a TrainConfig from `to_dict()` output (a run's config.json, a checkpoint's)."""
    values = {section: dict(fields) if isinstance(fields, dict) else fields
              for section, fields in values.items()}
    for (section, key), successor in RETIRED.items():
        fields = values.get(section)
        if not isinstance(fields, dict) or key not in fields:
            continue
        if successor is None:
            del fields[key]
        else:
            fields[key] = successor.get(fields[key], fields[key])
    model, data = values.get("model"), values.get("data")
    if isinstance(model, dict) and "arch" not in model:
        model["arch"] = "gpt2"  # saved before model.arch existed, when every model was GPT-2's
    if isinstance(data, dict) and "align" not in data:
        data["align"] = "stream"  # saved before data.align existed: every row was a window
    return overlay(TrainConfig(), values, source)


# What belongs to one start of a run rather than to its training (changes.NOT_TRAINING): the
# first-start rule (a --reset applies once), the CPU threads and the data's local cache (each
# node's own), and leave to resume on another dataset (a switch is allowed by the start that
# asks for it, not by every start after it).
START_FIELDS = {"run": ("resume", "threads", "take_over"), "data": ("cache", "allow_switch")}
# What an `auto` resolved from run.device: resolved again when a start names another device.
FROM_DEVICE = {"run": ("precision", "backend"), "optim": ("muon_ns_dtype",),
               "model": ("attention",)}


def continued(saved: dict, flags: dict, source: str) -> TrainConfig:
    """A run's resolved config (its config.json) as the base of its next start: its training's
    settings, with this start's own (START_FIELDS) back at their defaults, the device's `auto`s
    back to auto when `flags` ({section: {field: text}}) name the device, and the schedule's end
    back to 0 where it is the run.steps it was resolved from (resume.settle keeps it, or
    stretches a wsd run in its flat phase, as for a command given whole) or where `flags` start
    a schedule (optim.schedule_start: its end is its own, run.steps unless they give one)."""
    cfg = from_dict(saved, source)
    fresh = TrainConfig()
    back: dict = {}
    fields = dict(START_FIELDS)
    if "device" in flags.get("run", {}):
        for section, names in FROM_DEVICE.items():
            fields[section] = fields.get(section, ()) + names
    for section, names in fields.items():
        back.setdefault(section, {}).update(
            {name: getattr(getattr(fresh, section), name) for name in names})
    if cfg.optim.decay_steps == cfg.run.steps or "schedule_start" in flags.get("optim", {}):
        back.setdefault("optim", {})["decay_steps"] = 0
    return overlay(cfg, back, source)


def build(preset: str | None, config_file: str | None, flags: dict,
          shape: Callable[[TrainConfig, dict], TrainConfig] | None = None,
          base: TrainConfig | None = None) -> TrainConfig:
    """preset -> TOML file -> command-line flags ({section: {field: text}}), each validated;
    or `base` (a run's config, `continued`) -> flags. `shape(cfg, explicit)`: for
    model.init_from, the model's shape from the weights, checked against the fields the user
    set (init_from.apply_shape; the caller passes it, so the config imports no component): a
    base has its shape already, unless the flags name other weights.

    The model's section comes first, then the shape, then the rest: a data.seq_len longer than
    the default block_size is checked against the weights' (GPT-2's 1024), not the default's."""
    from ddpgpt.config.presets import get_preset

    file_values = load_toml(config_file) if config_file else {}
    if isinstance(file_values.get("data"), dict) and "sources" in file_values["data"]:
        file_values["data"] = sources_table(file_values["data"], config_file)
    file_preset = file_values.pop("preset", None)
    preset = preset or file_preset
    if base is not None:
        cfg = base
    else:
        cfg = get_preset(preset) if preset else TrainConfig()
    layers = [(file_values, config_file, check_type), (flags, "command line", parse_text)]
    for values, source, convert in layers:
        if values.get("model"):
            cfg = overlay(cfg, {"model": values["model"]}, source, convert)
    reshape = base is None or "init_from" in flags.get("model", {})
    if cfg.model.init_from and shape is not None and reshape:
        # what the user set must agree with the weights
        explicit = {name: config_file for name in file_values.get("model", {})}
        explicit.update({name: "command line" for name in flags.get("model", {})})
        cfg = shape(cfg, explicit)
    for values, source, convert in layers:
        rest = {k: v for k, v in values.items() if k != "model"}
        if rest:
            cfg = overlay(cfg, rest, source, convert)
    return cfg


# ---- flags --------------------------------------------------------------------------------------

def add_flags(parser: argparse.ArgumentParser, cls: type, section: str | None = None,
              shown=None, listed: Callable[[str], bool] | None = None) -> None:
    """One flag per dataclass field: `--name` or, in a section, `--section.name` (dashes; the
    underscore spelling works too, unlisted). Values stay strings here; `parse_text` converts
    them and names the field. `shown`: an instance whose values `--help` shows as the defaults
    (a preset's section). `listed(dest)`: whether `--help` lists the flag (all by default); an
    unlisted flag works all the same."""
    docs, types_ = field_docs(cls), field_types(cls)
    about = " ".join((cls.__doc__ or "").split())
    group = parser.add_argument_group(section, about) if section else parser
    for f in dataclasses.fields(cls):
        dest = f"{section}.{f.name}" if section else f.name
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        if shown is not None:
            default = getattr(shown, f.name)
        kind = base_type(types_[f.name])
        told = "" if default in (None, "", [], False) else f" (default: {default})"
        help_ = f"{docs.get(f.name, '')}{told}".lstrip()
        if listed is not None and not listed(dest):
            help_ = argparse.SUPPRESS
        if kind is list:  # the positional sources of `prepare`
            group.add_argument(dest, nargs="*", default=argparse.SUPPRESS, help=help_,
                               metavar=f.name.upper().rstrip("S"))
            continue
        flags = [f"--{dest.replace('_', '-')}"]
        if "alias" in f.metadata:
            flags.insert(0, f.metadata["alias"])
        action = argparse.BooleanOptionalAction if kind is bool else "store"
        value = {} if kind is bool else {"metavar": f.name.upper()}
        group.add_argument(*flags, dest=dest, action=action, default=argparse.SUPPRESS, help=help_,
                           **value)
        if "_" in f.name:  # --section.field_name, as a config file spells it
            group.add_argument(f"--{dest}", dest=dest, action=action, default=argparse.SUPPRESS,
                               help=argparse.SUPPRESS, **value)


def flat_config(cls: type, values: dict):
    """A one-section config (prepare, sample, ...) from parsed flag values."""
    types_ = field_types(cls)
    return cls(**{k: parse_text(v, types_[k], f"--{k.replace('_', '-')}")
                  for k, v in values.items() if k in types_})


def nest(values: dict) -> dict:
    """{"optim.lr": "3e-4"} -> {"optim": {"lr": "3e-4"}}; keys outside the sections are dropped."""
    nested: dict = {}
    for key, value in values.items():
        section, _, name = key.partition(".")
        if section in SECTIONS and name:
            nested.setdefault(section, {})[name] = value
    return nested


def to_toml(cfg: TrainConfig) -> str:
    """The config as a TOML file that `--config` reads back to the same config."""
    lines = []
    for section, fields in cfg.to_dict().items():
        lines.append(f"[{section}]")
        for name, value in fields.items():
            if value is None:  # unset (a model piece: model.arch's), as the file leaves it
                continue
            if isinstance(value, bool):
                text = "true" if value else "false"
            elif isinstance(value, str):
                text = json.dumps(value)  # a TOML basic string: JSON's escapes
            else:
                text = repr(value)
            lines.append(f"{name} = {text}")
        lines.append("")
    return "\n".join(lines)

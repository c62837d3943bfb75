"""How a config is built: preset -> TOML file -> command-line flags, each layer checked.

    resolve("tiny", "run.toml", {"optim": {"lr": "3e-4"}})   # -> TrainConfig

A TOML file has sections [model] [data] [optim] [run] and an optional top-level `preset`. Flag
values arrive as strings and are converted to the field's type; TOML values must already have it
("4" is a string there, not an integer). Field docstrings (read from the source) become `--help`.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import sys
import types
from pathlib import Path
from typing import Any, Union, get_args, get_origin, get_type_hints

from ddpgpt.config import SECTIONS, ConfigError, TrainConfig


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The docstring written under each field of a dataclass (what `--help` shows)."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            docs[node.target.id] = " ".join(str(nxt.value.value).split())
    return docs


def field_types(cls: type) -> dict[str, Any]:
    hints = get_type_hints(cls, vars(sys.modules[cls.__module__]))
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def base_type(tp: Any) -> Any:
    """`str | None` -> str; `list[str]` -> list; plain types unchanged."""
    if get_origin(tp) in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        return base_type(args[0])
    return get_origin(tp) or tp


def coerce(value: Any, tp: Any, where: str, text: bool = False) -> Any:
    """Converts a command-line string (`text`) to the field's type, or checks a typed value (TOML,
    config.json): there "4" is a string, not an integer."""
    kind = base_type(tp)
    if value is None and type(None) in get_args(tp):
        return None
    names = {int: "an integer", float: "a number", bool: "true or false", str: "a string", list: "a list"}
    if text and isinstance(value, str) and kind is not str and kind is not list:
        try:
            if kind is bool:
                if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
                    raise ValueError
                return value.lower() in ("true", "1", "yes")
            return kind(value)
        except ValueError:
            raise ConfigError(f"{where}: expected {names[kind]}, got {value!r}") from None
    ok = isinstance(value, kind) and not (kind in (int, float) and isinstance(value, bool))
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not ok:
        raise ConfigError(f"{where}: expected {names[kind]}, got {value!r} ({type(value).__name__})")
    return value


def apply(cfg: TrainConfig, values: dict, source: str, text: bool = False) -> TrainConfig:
    """A copy of `cfg` with the nested `values` ({section: {field: value}}) applied and validated.
    `text`: the values are command-line strings to convert; otherwise they must have the field's
    type. Errors name `source` (a file) and the field."""
    sections = {}
    for section, fields in values.items():
        if section not in SECTIONS:
            raise ConfigError(f"{source}: unknown section [{section}]; known: {', '.join(SECTIONS)}")
        if not isinstance(fields, dict):
            raise ConfigError(f"{source}: [{section}] must be a table of fields, got {fields!r}")
        current = getattr(cfg, section)
        types_ = field_types(type(current))
        changes = {}
        for name, value in fields.items():
            if name not in types_:
                raise ConfigError(f"{source}: unknown key {section}.{name}; known: {', '.join(types_)}")
            changes[name] = coerce(value, types_[name], f"{source}: {section}.{name}", text)
        sections[section] = _replace(current, changes, source, text)
    return _replace(cfg, sections, source, text)


def _replace(obj, changes: dict, source: str, text: bool):
    """dataclasses.replace; its validation errors (__post_init__) name the file they came from."""
    try:
        return dataclasses.replace(obj, **changes)
    except ConfigError as e:
        if text:
            raise
        raise ConfigError(f"{source}: {e}") from None


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


def from_dict(values: dict, source: str = "config.json") -> TrainConfig:
    """Rebuilds a TrainConfig from `to_dict()` output (a checkpoint's or run dir's config)."""
    return apply(TrainConfig(), values, source)


def resolve(preset: str | None, config_file: str | None, overrides: dict) -> TrainConfig:
    """preset -> TOML file -> command-line overrides, each layer validated."""
    from ddpgpt.presets import get_preset

    file_values = load_toml(config_file) if config_file else {}
    file_preset = file_values.pop("preset", None)
    preset = preset or file_preset
    cfg = get_preset(preset) if preset else TrainConfig()
    if file_values:
        cfg = apply(cfg, file_values, config_file)
    return apply(cfg, overrides, "command line", text=True)

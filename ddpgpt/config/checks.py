"""The checks every config section runs on its values, and the error they raise: one line naming
the field and the fix. Imports nothing of ddpgpt but errors."""

from __future__ import annotations

import dataclasses
import math
from typing import get_args

from ddpgpt.errors import UserError, did_you_mean


class ConfigError(UserError):
    """A config value that is unknown, of the wrong type, or out of range."""


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(f"invalid config: {message}")


def _finite(obj, prefix: str) -> None:
    """Every float field a finite number: inf or nan passes a `> 0` check and fails much later
    (an overflow deep inside DDP, a NaN loss), after files were written."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if isinstance(value, float):
            name = (f"--{f.name.replace('_', '-')} {value}" if prefix == "--"
                    else f"{prefix}{f.name} = {value}")
            _require(math.isfinite(value), f"{name} must be a finite number")


def _number(text: str) -> bool:
    """`text` reads as a finite number."""
    try:
        return math.isfinite(float(text))
    except ValueError:
        return False


def _choice(section: str, name: str, value: str, options) -> None:
    """`value` one of `options`: a Literal type (choices.py) or a sequence of names (a table's)."""
    options = get_args(options) or tuple(options)
    _require(value in options, f"{section}.{name} = {value!r}{did_you_mean(value, options)}; "
             f"choose one of {', '.join(options)}")


def _shares(spec: str, weights: list[tuple[str, float | None]]) -> list[tuple[str, float]]:
    """A mixture's weights (None: unweighted, 1) normalized to sum to 1, or one line: a sum that
    overflows a float, or a weight that is 0 beside it, would make every share 0 (or one)."""
    total = sum(share or 1.0 for _, share in weights)
    _require(math.isfinite(total), f"data.dir = {spec!r}: the weights add up to more than a "
             "float holds (every share would be 0); give weights of a sensible size (a:0.7,b:0.3)")
    small = next((path for path, share in weights if share and not share / total), None)
    _require(small is None, f"data.dir = {spec!r}: the weight of {small} is 0 beside the "
             "others' sum (too small for a float); give weights of a sensible size (a:0.7,b:0.3)")
    return [(path, (share or 1.0) / total) for path, share in weights]

"""The table of eval task kinds: how a kind's task file is read, how its tasks are scored, and
which scores they report. It imports no torch, so the command line, the run's progress line and
`ddpgpt plot` read it freely; a kind's code is imported only when a task of that kind is loaded.

    --task hellaswag             a multiple-choice task (the default kind; hellaswag downloads)
    --task piqa --task-data F    the same kind, from F
    --task KIND:NAME             a task of another kind; its scores are NAME_<metric>
    --task core --task-data DIR  a bundle of tasks (a kind with `read`): its name alone names it

A kind is one module and one row here. The module holds:
    a line parser, `parse(line, where)`: one line of a task file as one example, or a DataError
        naming `where` (FILE:LINE) and what is wrong; or, for a bundle of tasks (a directory),
        `read(path, limit)`: its tasks, each with its examples, or a DataError;
    a scorer class, `Scorer(task, tokenizer, block_size, env)`: this rank's share of the task's
        examples, prepared once; `.score(model, autocast, bar)` is collective (every rank calls
        it, on the unwrapped model) and returns {metric: value for each of the row's metrics,
        "n": the examples scored}, the same at any number of processes; a bundle's adds
        {PART_<metric>: value for each of its tasks and the row's `parts`, PART_n}.
evals/scorer.py runs the scorers and adds each task's seconds (NAME_s).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from ddpgpt.errors import UserError, did_you_mean


@dataclass(frozen=True)
class Kind:
    name: str
    parse: str                # "module:function" (see above)
    scorer: str               # "module:class" (see above)
    metrics: tuple[str, ...]  # what each task reports, NAME_<metric>, in the order eval prints
    headline: str             # the one metric the progress line and `ddpgpt plot` show
    label: str                # the headline's axis label in `ddpgpt plot`
    row: str                  # one line of a task file (a bundle: its directory), as errors say
    read: str = ""            # a bundle's reader, "module:function" (see above); "": line by line
    parts: tuple[str, ...] = ()  # what each task of a bundle reports, NAME_<PART>_<metric>


DEFAULT = "multiple_choice"

KINDS: dict[str, Kind] = {k.name: k for k in (
    # llm.c's HellaSwag rule and its lines' parser (evals/multiple_choice.py)
    Kind("multiple_choice", "ddpgpt.evals.multiple_choice:example",
         "ddpgpt.evals.multiple_choice:TaskScorer", metrics=("acc_norm", "acc", "acc_char"),
         headline="acc_norm", label="acc_norm (llm.c's HellaSwag rule)",
         row='{"ctx": ..., "endings": [...], "label": ...}'),
    # the same tasks asked in the chat template, the choice as the assistant's reply
    Kind("chat", "ddpgpt.evals.multiple_choice:example", "ddpgpt.evals.chat_choice:ChatScorer",
         metrics=("acc_norm", "acc", "acc_char"), headline="acc_norm",
         label="acc_norm (the chat format)", row='{"ctx": ..., "endings": [...], "label": ...}'),
    # DCLM's CORE tasks as nanochat scores them (evals/bundle.py reads, evals/core.py scores)
    Kind("core", "", "ddpgpt.evals.core:CoreScorer", metrics=("metric",), headline="metric",
         label="CORE (centered accuracy, nanochat's)",
         row="eval bundle directory (core.yaml, eval_meta_data.csv, eval_data/)",
         read="ddpgpt.evals.bundle:read", parts=("acc", "centered")),
)}


def split(spec: str, flag: str) -> tuple[str, str]:
    """("multiple_choice", "piqa") for "piqa"; ("core", "core") for "core" (a bundle kind's name
    alone); (KIND, NAME) for "KIND:NAME", or one line naming the kinds there are."""
    kind, _, name = spec.rpartition(":")
    bundle = name in KINDS and KINDS[name].read
    kind = kind or (name if bundle else DEFAULT)
    if kind not in KINDS:
        raise UserError(f"{flag} {spec}: unknown task kind {kind!r}"
                        f"{did_you_mean(kind, tuple(KINDS))}; choose one of "
                        f"{', '.join(KINDS)} (KIND:NAME)")
    return kind, name


def load(target: str):
    """The function or class a row names ("module:attribute")."""
    module, name = target.split(":")
    return getattr(importlib.import_module(module), name)


def headlines(row: dict) -> dict[str, str]:
    """{task name: the key of its headline score} for every task an eval row (metrics.jsonl's, or
    a Scorer's) holds: a task is named by its NAME_n key, and its headline is that of the first
    kind in the table whose headline it reports (label_of names it)."""
    out = {}
    for key in row:
        name = key.removesuffix("_n")
        if key.endswith("_n") and name:
            found = next((f"{name}_{k.headline}" for k in KINDS.values()
                          if f"{name}_{k.headline}" in row), None)
            if found:
                out[name] = found
    return out


def label_of(name: str, key: str) -> str:
    """The axis label of task `name`'s headline score `key` (one of headlines' values)."""
    return next(k.label for k in KINDS.values() if key == f"{name}_{k.headline}")

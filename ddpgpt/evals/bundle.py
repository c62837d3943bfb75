"""A CORE eval bundle, read: DCLM's layout, which nanochat downloads as eval_bundle.zip
(docs/gpt2.md), and the text of each example's prompts. Torch-free; evals/core.py scores them.

    BUNDLE/core.yaml           icl_tasks: a list, each with a label, a dataset_uri (a file
                               under eval_data/), an icl_task_type, num_fewshot (a list: its
                               first element counts; or one number) and continuation_delimiter
                               (" " when absent)
    BUNDLE/eval_meta_data.csv  a row per task: "Eval Task" (the label), "Random baseline" (in
                               percent: chance accuracy, which centers to 0); other columns
                               are not read. One row a label; baselines that read as fractions
                               (all 1 or less, or a task's far below its choices' chance) are
                               refused: nothing says which unit a 0.25 meant
    BUNDLE/eval_data/FILE      one example per line, by the task's type:
        multiple_choice    {"query": str, "choices": [str, ...], "gold": INDEX}
        schema             {"context_options": [str, ...], "continuation": str, "gold": INDEX}
        language_modeling  {"context": str, "continuation": str}
    (docs/gpt2.md, "Your own CORE tasks", has a bundle of each type written out.)

Each task's examples are shuffled as nanochat shuffles them (random.Random(1337) over the file's
lines), then the first `limit` kept (0: all): a cap takes the same examples as nanochat's
max_per_task. Example i of a k-shot task is shown k others first, drawn as nanochat draws them
(random.Random(1234 + i).sample of the other indices of the capped list), each solved, then a
blank line. Following nanochat's draws rather than our own makes a task's prompts, and so its
accuracy, the same as nanochat's for the same model. A bad line, a missing file or field, a label
the csv does not list, an example whose gold choice (or context option) is another's text (the
tie rule would score it, not the model), or fewer examples than a task's shots need is one line
naming the file.
"""

from __future__ import annotations

import csv
import json
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml

from ddpgpt.errors import DataError

BUNDLE_URL = "https://karpathy-public.s3.us-west-2.amazonaws.com/eval_bundle.zip"  # nanochat's
SHUFFLE_SEED, SHOTS_SEED = 1337, 1234  # nanochat's: the examples' order, the shots' draw
TYPES = ("multiple_choice", "schema", "language_modeling")
LABEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")  # it names metrics: core_<label>_acc
GIVE = (f"give the eval bundle's directory (core.yaml, eval_meta_data.csv, eval_data/; "
        f"nanochat's: {BUNDLE_URL}, unzipped)")


@dataclass(frozen=True)
class Question:
    """multiple_choice: the query, then each choice after the delimiter."""
    query: str
    choices: tuple[str, ...]
    gold: int


@dataclass(frozen=True)
class Schema:
    """schema: each context option, then the one continuation after the delimiter."""
    options: tuple[str, ...]
    continuation: str
    gold: int


@dataclass(frozen=True)
class Passage:
    """language_modeling: the context, then the continuation the model must produce greedily."""
    context: str
    continuation: str


@dataclass(frozen=True)
class Part:
    """One task of a bundle, its examples shuffled and capped."""
    label: str
    type: str         # one of TYPES
    shots: int        # solved examples shown before each one
    delimiter: str    # between a context and what follows it
    baseline: float   # chance accuracy, percent
    source: str       # its jsonl
    examples: tuple   # Question, Schema or Passage


def read(path: Path, limit: int = 0) -> tuple[Part, ...]:
    """Every task of the bundle at `path`, in core.yaml's order (see the module's docstring)."""
    path = Path(path)
    config = path / "core.yaml"
    if path.is_file():
        raise DataError(f"{path}: a file, not a directory; {GIVE} (a task file of another kind "
                        "named core: --task KIND:core)")
    if not config.is_file():
        raise DataError(f"{path}: no core.yaml there; {GIVE}")
    tasks = _icl_tasks(config)
    baselines = _baselines(path / "eval_meta_data.csv")
    parts, seen = [], set()
    for number, task in enumerate(tasks, 1):
        where = f"{config}: icl_tasks entry {number}"
        label, kind, file, shots, delimiter = _entry(task, where)
        if label in seen:
            raise DataError(f"{where}: label {label!r} is there twice; each task's label must be "
                            "its own (it names its scores)")
        seen.add(label)
        if label not in baselines:
            raise DataError(f"{path / 'eval_meta_data.csv'}: no row for {label!r} (its Random "
                            f"baseline centers the task's accuracy); add one, or drop the task "
                            "from core.yaml")
        source = path / "eval_data" / file
        examples = _examples(source, kind)
        baseline = _in_percent(label, kind, examples, baselines[label],
                               path / "eval_meta_data.csv")
        random.Random(SHUFFLE_SEED).shuffle(examples)
        examples = examples[:limit] if limit else examples
        if len(examples) <= shots:
            capped = f" (the first {limit} kept)" if limit and len(examples) == limit else ""
            raise DataError(f"{where}: {label} is {shots}-shot but has {len(examples)} "
                            f"example(s){capped}: each needs {shots} others; give at least "
                            f"{shots + 1} (a larger limit) or lower its num_fewshot")
        parts.append(Part(label, kind, shots, delimiter, baseline, str(source),
                          tuple(examples)))
    return tuple(parts)


def _icl_tasks(config: Path) -> list:
    try:
        loaded = yaml.safe_load(config.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"{config}: cannot read it ({e})") from None
    except yaml.YAMLError as e:
        raise DataError(f"{config}: not YAML ({' '.join(str(e).split())})") from None
    tasks = loaded.get("icl_tasks") if isinstance(loaded, dict) else None
    if not isinstance(tasks, list) or not tasks:
        raise DataError(f"{config}: no icl_tasks list; {GIVE}")
    return tasks


def _entry(task, where: str) -> tuple[str, str, str, int, str]:
    """(label, type, dataset_uri, shots, delimiter) of one icl_tasks entry."""
    if not isinstance(task, dict):
        raise DataError(f"{where}: not a mapping (label, dataset_uri, icl_task_type, ...)")
    missing = [k for k in ("label", "dataset_uri", "icl_task_type") if k not in task]
    if missing:
        raise DataError(f"{where}: missing {', '.join(missing)}")
    label, kind, file = (str(task[k]) for k in ("label", "icl_task_type", "dataset_uri"))
    if not LABEL.fullmatch(label):
        raise DataError(f"{where}: label {label!r} must be letters, digits, _, . or - (it "
                        "names the task's scores)")
    if kind not in TYPES:
        raise DataError(f"{where}: {label} has icl_task_type {kind!r}; CORE's are "
                        f"{', '.join(TYPES)}")
    shots = task.get("num_fewshot", [0])
    shots = shots[0] if isinstance(shots, list) and shots else shots
    if isinstance(shots, bool) or not isinstance(shots, int) or shots < 0:
        raise DataError(f"{where}: {label}'s num_fewshot {task.get('num_fewshot')!r} is not a "
                        "count (a list whose first element is 0 or more)")
    delimiter = task.get("continuation_delimiter", " ")
    if not isinstance(delimiter, str):
        raise DataError(f"{where}: {label}'s continuation_delimiter {delimiter!r} is not text")
    return label, kind, file, shots, delimiter


def _baselines(path: Path) -> dict[str, tuple[float, int]]:
    """{label: (random baseline in percent, its line)} from eval_meta_data.csv, read past a byte
    order mark (a spreadsheet's UTF-8); one row a label, and not every baseline a fraction."""
    try:
        with open(path, encoding="utf-8-sig", newline="") as f:
            reader = csv.DictReader(f)
            rows = [(reader.line_num, row) for row in reader]
            header = reader.fieldnames or []
    except FileNotFoundError:
        raise DataError(f"{path}: no such file; {GIVE}") from None
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise DataError(f"{path}: cannot read it ({e})") from None
    if not {"Eval Task", "Random baseline"} <= set(header):
        raise DataError(f"{path}: no 'Eval Task' and 'Random baseline' columns (its header: "
                        f"{', '.join(header) or 'none'})")
    out = {}
    for number, row in rows:
        label = row["Eval Task"]
        try:
            value = float(row["Random baseline"])
        except (TypeError, ValueError):
            raise DataError(f"{path}:{number}: Random baseline {row['Random baseline']!r} is "
                            "not a number (percent)") from None
        if not 0 <= value < 100:
            raise DataError(f"{path}:{number}: Random baseline {value:g} is not a percentage "
                            "below 100")
        if label in out:
            raise DataError(f"{path}:{number}: a second row for {label!r} (the first is line "
                            f"{out[label][1]}); keep one row a task")
        out[label] = value, number
    given = [f"{label} {value:g}" for label, (value, _) in out.items() if value > 0]
    if given and all(value <= 1 for value, _ in out.values()):
        listed = ", ".join(given[:3]) + (", ..." if len(given) > 3 else "")
        raise DataError(f"{path}: every Random baseline is 1 or less ({listed}): fractions, "
                        "where the column is in percent (25 for one chance in four); write "
                        "each times 100")
    return out


def _in_percent(label: str, kind: str, examples: list, row: tuple[float, int],
                path: Path) -> float:
    """A task's baseline, refused where it reads as a fraction: 1 percent or less (and not 0)
    for examples of fewer than 100 choices, whose chance is more than 1 percent."""
    value, number = row
    if kind == "language_modeling" or not 0 < value <= 1:
        return value
    most = max(len(e.choices if kind == "multiple_choice" else e.options) for e in examples)
    if most >= 100:
        return value
    noun = "choices" if kind == "multiple_choice" else "context options"
    raise DataError(f"{path}:{number}: {label}'s Random baseline {value:g} is {value:g} percent, "
                    f"but its examples have at most {most} {noun} (chance {100 / most:.3g} "
                    f"percent or more): the column is in percent; write {value * 100:g} for a "
                    f"chance of {value:g}")


def _examples(source: Path, kind: str) -> list:
    """Every example of a task's jsonl, each line checked."""
    try:
        lines = source.read_bytes().splitlines()
    except FileNotFoundError:
        raise DataError(f"{source}: no such file (core.yaml's dataset_uri, under eval_data/); "
                        f"{GIVE}") from None
    except OSError as e:
        raise DataError(f"{source}: cannot read it ({e.strerror or e})") from None
    out = []
    for number, raw in enumerate(lines, 1):
        if raw.strip():
            out.append(example(raw, kind, f"{source}:{number}"))
    if not out:
        raise DataError(f"{source}: no examples")
    return out


FIELDS = {"multiple_choice": '{"query": ..., "choices": [...], "gold": INDEX}',
          "schema": '{"context_options": [...], "continuation": ..., "gold": INDEX}',
          "language_modeling": '{"context": ..., "continuation": ...}'}


def example(raw: bytes, kind: str, where: str) -> Question | Schema | Passage:
    """One line of a task of type `kind`, or one line of error naming FILE:LINE."""
    def bad(what: str) -> DataError:
        return DataError(f"{where}: {what}; each line of a {kind} task must be {FIELDS[kind]}")
    try:
        row = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise DataError(f"{where}: not UTF-8 (byte 0x{raw[e.start]:02x} at column "
                        f"{e.start + 1}); save the file as UTF-8") from None
    except ValueError as e:
        raise bad(f"not JSON ({e})") from None
    if not isinstance(row, dict):
        raise bad(f"a JSON {type(row).__name__}, not an object")
    names = {"multiple_choice": ("query", "choices", "gold"),
             "schema": ("context_options", "continuation", "gold"),
             "language_modeling": ("context", "continuation")}[kind]
    missing = [k for k in names if k not in row]
    if missing:
        raise bad(f"missing field {', '.join(missing)}")
    for name in names:
        value = row[name]
        if name in ("choices", "context_options"):
            if not isinstance(value, list) or len(value) < 2 or \
                    not all(isinstance(v, str) for v in value):
                raise bad(f"{name} must be a list of at least 2 strings")
        elif name == "gold":
            options = len(row["choices" if kind == "multiple_choice" else "context_options"])
            if isinstance(value, bool) or not isinstance(value, int) or \
                    not 0 <= value < options:
                raise bad(f"gold {value!r} is not an index into the {options} "
                          f"{'choices' if kind == 'multiple_choice' else 'context_options'}")
        elif not isinstance(value, str):
            raise bad(f"{name} is a {type(value).__name__}, not a string")
    if "continuation" in names and not row["continuation"].strip():
        raise bad("continuation is empty (it is what is scored)")
    if kind != "language_modeling":
        options = "choices" if kind == "multiple_choice" else "context_options"
        _apart(row[options], row["gold"], options, where)
    if kind == "multiple_choice":
        return Question(row["query"], tuple(row["choices"]), row["gold"])
    if kind == "schema":
        return Schema(tuple(row["context_options"]), row["continuation"], row["gold"])
    return Passage(row["context"], row["continuation"])


def _apart(options: list[str], gold: int, name: str, where: str) -> None:
    """One line if another choice (or context option) is the gold one's text: their rows are
    the same, so the tie rule would decide the example, not the model. Alike choices besides
    the gold one stay: the model can still tell the answer from them (ARC has such examples)."""
    twin = next((k for k, text in enumerate(options) if k != gold and text == options[gold]),
                None)
    if twin is None:
        return
    text = options[gold] if len(options[gold]) <= 40 else options[gold][:37] + "..."
    first, second = sorted((gold, twin))
    raise DataError(f"{where}: {name} {first} and {second} are the same text ({text!r}), one "
                    "of them gold: no model can tell the answer from the other; make each "
                    f"{'choice' if name == 'choices' else 'option'} its own text, or drop the "
                    "line")


# ---- prompts ------------------------------------------------------------------------------------

class _Others(Sequence):
    """range(n) without i, as a sequence: what random.sample draws the shots from, the same
    draws as from the list nanochat builds, without building it for every example."""

    def __init__(self, n: int, i: int):
        self.n, self.i = n, i

    def __len__(self) -> int:
        return self.n - 1

    def __getitem__(self, j: int) -> int:
        if not 0 <= j < self.n - 1:
            raise IndexError(j)
        return j + (j >= self.i)


def shots(n: int, i: int, k: int) -> list[int]:
    """The indices of example i's k shots among n examples (never i itself)."""
    return random.Random(SHOTS_SEED + i).sample(_Others(n, i), k) if k else []


def solved(example, delimiter: str) -> str:
    """An example with its answer, as a shot shows it."""
    if isinstance(example, Question):
        return f"{example.query}{delimiter}{example.choices[example.gold]}"
    if isinstance(example, Schema):
        return f"{example.options[example.gold]}{delimiter}{example.continuation}"
    return f"{example.context.strip()}{delimiter}{example.continuation}"


def prompts(part: Part, i: int) -> list[str]:
    """Example i's texts: one per choice (multiple_choice) or context option (schema), each
    after its shots; language_modeling: the prompt up to the continuation, stripped of the
    whitespace at its ends (nanochat's rule: the continuation then starts on a token boundary),
    and the prompt with it."""
    d, ex = part.delimiter, part.examples[i]
    first = "".join(solved(part.examples[j], d) + "\n\n"
                    for j in shots(len(part.examples), i, part.shots))
    if isinstance(ex, Question):
        return [f"{first}{ex.query}{d}{choice}" for choice in ex.choices]
    if isinstance(ex, Schema):
        return [f"{first}{option}{d}{ex.continuation}" for option in ex.options]
    context = f"{first}{ex.context.strip()}{d}"
    return [context.strip(), context + ex.continuation]

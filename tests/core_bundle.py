"""A small CORE eval bundle in DCLM's layout, made for the tests: three tasks, one of each type.

    mc      multiple_choice     2-shot, delimiter "\\nAnswer: ", 4 choices, random baseline 25
    wino    schema              1-shot, the default delimiter (" "), 2 options, baseline 50
    lm      language_modeling   3-shot, delimiter " => ", baseline 0

Example i's gold index is i % (its number of choices), so a model that always picks the first
(one that ties every choice) scores each task's random baseline exactly. Every query, context
option and context is unique, so a model that has seen the solved prompts can predict each one.
"""

from __future__ import annotations

import csv
import json
import random
from pathlib import Path

WORDS = ("apple river stone cloud green tiger paper seven quiet music bright window honey "
         "silver garden winter laser orange planet candle").split()
CORE_YAML = """\
icl_tasks:
-
  label: mc
  dataset_uri: knowledge/mc.jsonl
  num_fewshot: [2]
  icl_task_type: multiple_choice
  continuation_delimiter: "\\nAnswer: "
-
  label: wino
  dataset_uri: language/wino.jsonl
  num_fewshot: [1]
  icl_task_type: schema
-
  label: lm
  dataset_uri: symbolic/lm.jsonl
  num_fewshot: [3]
  icl_task_type: language_modeling
  continuation_delimiter: " => "
"""
BASELINES = {"mc": 25, "wino": 50, "lm": 0, "unused_task": 33.3}


def write_bundle(root: Path, n: int = 12, seed: int = 0) -> Path:
    """The bundle at root/eval_bundle, `n` examples per task."""
    rng = random.Random(seed)

    def words(k: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(k))

    out = root / "eval_bundle"
    rows = {
        "knowledge/mc.jsonl": [{"query": f"Question {i}: what comes after {words(3)}?",
                                "choices": [words(rng.randint(1, 3)) for _ in range(4)],
                                "gold": i % 4} for i in range(n)],
        "language/wino.jsonl": [{"context_options": [f"The {words(1)} saw case {i}",
                                                     f"A {words(2)} met case {i}"],
                                 "continuation": f"and then it was {words(2)}.",
                                 "gold": i % 2} for i in range(n)],
        "symbolic/lm.jsonl": [{"context": f" copy {i}: {words(2)}  ",
                               "continuation": words(rng.randint(1, 2))} for i in range(n)],
    }
    for name, lines in rows.items():
        (out / "eval_data" / name).parent.mkdir(parents=True, exist_ok=True)
        (out / "eval_data" / name).write_text("".join(json.dumps(r) + "\n" for r in lines))
    (out / "core.yaml").write_text(CORE_YAML)
    with open(out / "eval_meta_data.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["Eval Task", "Task Category", "Task Type", "#shots", "Random baseline"])
        for label, baseline in BASELINES.items():
            writer.writerow([label, "test", "test", 0, baseline])
    return out

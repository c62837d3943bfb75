"""An independent implementation of CORE as nanochat's core_eval defines it, the oracle of
ddpgpt's evals/bundle.py and evals/core.py. Written from the definition, sharing no code with
ddpgpt: plain lists, one row per forward, Python's min and max. Where nanochat's has no defined
answer (a choice with no tokens of its own: a mean over nothing), the example is wrong, as
docs/gpt2.md says ddpgpt scores it.

    read(bundle, limit)                 the tasks: examples shuffled by random.Random(1337), capped
    texts(task, data, i)                example i's prompts after its shots (random.Random(1234 + i)
                                        drawing from the list of the other indices)
    score(logits_of, encode, bos, block, bundle, limit) -> {label: (acc, centered)}, CORE,
                                        and each example's outcome

`logits_of(ids)` gives the (len(ids), V) logits of one row; `encode(text)` its ids.
"""

from __future__ import annotations

import csv
import json
import random

import torch
import yaml


def read(bundle, limit: int = 0) -> list[dict]:
    config = yaml.safe_load((bundle / "core.yaml").read_text())
    with open(bundle / "eval_meta_data.csv", newline="") as f:
        baselines = {row["Eval Task"]: float(row["Random baseline"]) for row in csv.DictReader(f)}
    tasks = []
    for entry in config["icl_tasks"]:
        lines = (bundle / "eval_data" / entry["dataset_uri"]).read_text().splitlines()
        data = [json.loads(line) for line in lines if line.strip()]
        random.Random(1337).shuffle(data)
        if limit:
            data = data[:limit]
        tasks.append({"label": entry["label"], "type": entry["icl_task_type"],
                      "shots": entry["num_fewshot"][0],
                      "delim": entry.get("continuation_delimiter", " "),
                      "baseline": baselines[entry["label"]], "data": data})
    return tasks


def texts(task: dict, data: list[dict], i: int) -> list[str]:
    """MC: one prompt per choice; schema: one per context option; LM: [without, with]."""
    d, item = task["delim"], data[i]
    others = [j for j in range(len(data)) if j != i]
    picked = random.Random(1234 + i).sample(others, task["shots"]) if task["shots"] else []
    before = ""
    for j in picked:
        s = data[j]
        if task["type"] == "multiple_choice":
            before += s["query"] + d + s["choices"][s["gold"]] + "\n\n"
        elif task["type"] == "schema":
            before += s["context_options"][s["gold"]] + d + s["continuation"] + "\n\n"
        else:
            before += s["context"].strip() + d + s["continuation"] + "\n\n"
    if task["type"] == "multiple_choice":
        return [before + item["query"] + d + c for c in item["choices"]]
    if task["type"] == "schema":
        return [before + c + d + item["continuation"] for c in item["context_options"]]
    start = before + item["context"].strip() + d
    return [start.strip(), start + item["continuation"]]


def _prefix(seqs) -> int:
    n = 0
    while n < min(map(len, seqs)) and all(s[n] == seqs[0][n] for s in seqs):
        n += 1
    return n


def _crop(ids: list[int], start: int, block: int) -> tuple[list[int], int]:
    """The last `block` ids and where the scored ones start in them (at least 1)."""
    if len(ids) > block:
        start -= len(ids) - block
        ids = ids[-block:]
    return ids, max(start, 1)


def outcome(task: dict, data: list[dict], i: int, logits_of, encode, bos: int,
            block: int) -> bool:
    rows = [[bos] + list(encode(t)) for t in texts(task, data, i)]
    if task["type"] == "language_modeling":
        without, full = rows
        ids, start = _crop(full, _prefix([without, full]), block)
        with torch.no_grad():
            logits = logits_of(ids)
        return all(int(logits[t - 1].argmax()) == ids[t] for t in range(start, len(ids)))
    if task["type"] == "multiple_choice":
        starts = [_prefix(rows)] * len(rows)
    else:
        same = _prefix([r[::-1] for r in rows])
        starts = [len(r) - same for r in rows]
    means = []
    for row, start in zip(rows, starts):
        ids, start = _crop(row, start, block)
        if start >= len(ids):  # nothing of this choice to score: the example is wrong
            return False
        with torch.no_grad():
            logp = torch.log_softmax(logits_of(ids).double(), -1)
        means.append(-sum(logp[t - 1, ids[t]].item() for t in range(start, len(ids)))
                     / (len(ids) - start))
    return means.index(min(means)) == data[i]["gold"]


def score(logits_of, encode, bos: int, block: int, bundle, limit: int = 0) -> dict:
    """{"core": CORE, LABEL: (acc, centered), "outcomes": {LABEL: [bool, ...]}}."""
    out, centered, outcomes = {}, [], {}
    for task in read(bundle, limit):
        data = task["data"]
        hits = [outcome(task, data, i, logits_of, encode, bos, block) for i in range(len(data))]
        acc = sum(hits) / len(hits)
        b = task["baseline"] / 100
        centered.append((acc - b) / (1 - b))
        out[task["label"]] = (acc, centered[-1])
        outcomes[task["label"]] = hits
    return {"core": sum(centered) / len(centered), "outcomes": outcomes, **out}

"""A multiple-choice set in HellaSwag's shape from a prepared dataset's validation documents: the
CPU-sized stand-in for HellaSwag when the model was trained on code (the demo's standard library),
where HellaSwag's English would say nothing.

    python -m benchmarks.next_line_task --data data/stdlib --out data/stdlib-next-line.jsonl
    ddpgpt train ... --run.eval-tasks next_line --run.eval-task-data data/stdlib-next-line.jsonl

Each example: `ctx` is a few consecutive lines of one validation document (never trained on),
`endings` are the line that follows them and 3 other lines of the validation documents of
about its length, shuffled; `label` is where the true line landed. Chance is 0.25; a model that
has learned how code continues beats it. The set is a pure function of the dataset and --seed.
"""

from __future__ import annotations

import argparse
import bisect
import json
import random
from pathlib import Path

import numpy as np

from ddpgpt.data.shards import TokenDataset
from ddpgpt.data.tokenizer import EOT_TEXT, load_tokenizer


def documents(data: str) -> list[str]:
    """The validation split's documents as text (they are separated by end-of-text)."""
    ds = TokenDataset(data)
    tok = load_tokenizer(ds.path, ds.tokenizer)
    tokens = np.concatenate(ds.tokens("val")).astype(np.int64)
    cuts = np.flatnonzero(tokens == ds.eot_id)
    return [tok.decode(part.tolist()) for part in np.split(tokens, cuts) if len(part) > 1]


def examples(docs: list[str], n: int, seed: int, context_lines: int = 6) -> list[dict]:
    rng = random.Random(seed)
    lines = [d.replace(EOT_TEXT, "").splitlines() for d in docs]
    by_length = sorted({line.strip() for doc in lines for line in doc if len(line.strip()) >= 12},
                       key=lambda line: (len(line), line))
    lengths = [len(line) for line in by_length]
    out, tries = [], 0
    while len(out) < n and tries < 100 * n:
        tries += 1
        doc = rng.choice(lines)
        if len(doc) <= context_lines:
            continue
        i = rng.randrange(context_lines, len(doc))
        answer = doc[i].strip()
        if len(answer) < 12:
            continue
        # distractors: lines of about the same length, so the length alone does not tell
        at = bisect.bisect_left(lengths, len(answer))
        near = [c for c in by_length[max(0, at - 40):at + 40] if c != answer]
        if len(near) < 3:
            continue
        endings = [answer, *rng.sample(near, 3)]
        rng.shuffle(endings)
        ctx = "\n".join(doc[i - context_lines:i]) + "\n"
        out.append({"ctx": ctx, "endings": endings, "label": endings.index(answer)})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default="data/stdlib")
    parser.add_argument("--out", default="data/stdlib-next-line.jsonl")
    parser.add_argument("--n", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rows = examples(documents(args.data), args.n, args.seed)
    Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {args.out}: {len(rows)} examples from {args.data}'s validation documents")


if __name__ == "__main__":
    main()

"""An independent implementation of llm.c's HellaSwag scoring (dev/data/hellaswag.py), the oracle of
ddpgpt's evals: each ending's row is the context's tokens then those of " " + ending, a mask marks
the ending's tokens, the rows are padded with 0 and go through the model whole; the losses of the
shifted tokens under the mask give the mean (acc_norm) and the sum (acc). Rows longer than the
block keep their last block tokens, the mask cut alike. Written from that definition, sharing no
code with ddpgpt/evals."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def ending_losses(model, ctx: list[int], endings: list[list[int]], block: int):
    """(sum, mean) of each ending's token losses, float64 lists."""
    rows, masks = [], []
    for end in endings:
        row, mask = ctx + end, [0] * len(ctx) + [1] * len(end)
        rows.append(row[-block:])
        masks.append(mask[-block:])
    width = max(len(r) for r in rows)
    tokens = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, (r, m) in enumerate(zip(rows, masks)):
        tokens[i, :len(r)] = torch.tensor(r)
        mask[i, :len(m)] = torch.tensor(m)
    with torch.no_grad():
        logits = model(tokens)[0].float()
    losses = F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten(),
                             reduction="none").view(len(rows), -1).double()
    shift_mask = mask[:, 1:].double()
    sums = (losses * shift_mask).sum(1)
    return sums.tolist(), (sums / shift_mask.sum(1)).tolist()


def accuracy(model, examples: list[dict], encode, block: int) -> dict:
    """{"acc_norm", "acc", "n"} over jsonl rows ({"ctx", "endings", "label"}); `encode(text)` is
    the tokenizer's list of ids."""
    norm = total = 0
    model.eval()
    for ex in examples:
        sums, means = ending_losses(model, encode(ex["ctx"]),
                                    [encode(" " + e) for e in ex["endings"]], block)
        norm += min(range(len(means)), key=means.__getitem__) == ex["label"]
        total += min(range(len(sums)), key=sums.__getitem__) == ex["label"]
    return {"acc_norm": norm / len(examples), "acc": total / len(examples), "n": len(examples)}


def write_examples(path, n: int, seed: int, long_every: int = 3) -> list[dict]:
    """A HellaSwag-shaped jsonl of `n` examples of ASCII words, every `long_every`-th with a
    context of a few hundred characters (longer than small test models' blocks)."""
    import json
    import random

    rng = random.Random(seed)
    words = ("a man is sitting on the roof he starts pulling up roofing using wrap to "
             "skis tiles holding cube then she runs over dog with ball").split()

    def text(lo, hi):
        return " ".join(rng.choice(words) for _ in range(rng.randint(lo, hi)))

    rows = [{"ctx": text(40, 80) if i % long_every == 0 else text(2, 8),
             "endings": [text(1, 10) for _ in range(4)], "label": rng.randrange(4),
             "ind": i} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows

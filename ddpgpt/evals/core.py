"""CORE: DCLM's low-variance tasks (a bundle: evals/bundle.py), each scored as nanochat's
core_eval scores it, its accuracy centered against chance, and their mean.

Each prompt (bundle.prompts) is tokenized with the tokenizer's end-of-text first: the token every
document of a ddpgpt dataset starts after, and GPT-2's <|endoftext|>, the BOS nanochat prepends
(a transformers model's is its config.json's bos_token_id: hf/pretrained.py). Then, by type:
- multiple_choice: the tokens after the longest prefix all the choices' rows share are the
  choice's; the choice with the lowest mean cross-entropy over them wins;
- schema: the tokens of the longest suffix all rows share (the continuation) are scored, after
  each context option; the lowest mean wins;
- language_modeling: the continuation's tokens (those after the longest prefix the prompt
  without it and the prompt with it share: the prompt's own tokens, where they are a prefix)
  must each be the model's greedy choice.
A tie goes to the lowest index. An example with a choice that has no tokens of its own (its row
a prefix of the others': "a" beside "a b") is wrong whatever the model: nothing of that choice is
scored, so no mean compares it with the answer (nanochat's mean over nothing is NaN, and its min()
then picks index 0 or skips the NaN by the order). An example whose gold choice is another's text
never gets here: bundle.py refuses it.
A row longer than the model's block keeps its last block_size tokens (nanochat's rule for GPT-2's
1024 positions), at least one scored. The logits are the model's own: soft-capped where the
model is (model.logit_softcap; nanochat's model caps at 15), not otherwise.

centered = (acc - b) / (1 - b) for the task's random baseline b (chance scores 0, all right 1);
CORE = the mean of the tasks' centered scores.

Any number of processes: the bundle's examples, task after task, are one list, and rank r scores
entries r, r + W, ...; one all-reduce sums each task's correct answers, so the figures are the
same at any W. Every rank runs the same number of forwards (a rank short of examples repeats one
without counting it; fsdp2's forward gathers): one forward per example, its rows padded to the
longest, whatever W is.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from ddpgpt import progress
from ddpgpt.distributed import collectives
from ddpgpt.distributed.group import DistEnv
from ddpgpt.errors import UserError
from ddpgpt.evals import bundle
from ddpgpt.evals.bundle import Part

CHUNK = 256  # examples tokenized per call (the tokenizers run a batch on every core)


@dataclass
class Rendered:
    """One example's rows for the model: row i is heads[i] then tails[i] (one shared head or tail
    is the same array in every row), and the tail is what is scored. `gold`: the right row's
    index; -1 for language modeling (its one row must be predicted greedily)."""
    heads: list[np.ndarray]  # int32; at most block_size tokens kept of each
    tails: list[np.ndarray]  # int32
    gold: int


def _shared(rows: list[np.ndarray], from_end: bool = False) -> int:
    """How many tokens every row shares at its start (or end)."""
    n = min(len(r) for r in rows)
    ends = np.stack([r[len(r) - n:] if from_end else r[:n] for r in rows])  # (rows, n)
    same = (ends == ends[0]).all(0)
    differ = np.flatnonzero(~(same[::-1] if from_end else same))
    return int(differ[0]) if len(differ) else n


def render(part: Part, indices: range | list[int], tokenizer, block_size: int) -> list[Rendered]:
    """Examples `indices` of `part`, tokenized (CHUNK at a time) and split into heads and tails."""
    bos = tokenizer.eot_id
    out = []
    for start in range(0, len(indices), CHUNK):
        chunk = indices[start:start + CHUNK]
        texts = [bundle.prompts(part, i) for i in chunk]
        ids = iter(tokenizer.encode_batch([t for ts in texts for t in ts]))
        for i, ts in zip(chunk, texts):
            rows = [np.concatenate([[bos], next(ids)]).astype(np.int32) for _ in ts]
            out.append(split(part, rows, i, block_size))
    return out


def split(part: Part, rows: list[np.ndarray], i: int, block_size: int) -> Rendered:
    """One example's token rows as heads and tails (see the module's docstring), copied out of
    the rows so that only what is scored and a head's last block_size tokens stay in memory."""
    def keep(head):
        return head[-block_size:].copy()
    if part.type == "multiple_choice":
        n = _shared(rows)
        head = keep(rows[0][:n])
        return Rendered([head] * len(rows), [r[n:].copy() for r in rows], part.examples[i].gold)
    if part.type == "schema":
        n = _shared(rows, from_end=True)
        tail = rows[0][len(rows[0]) - n:].copy()
        return Rendered([keep(r[:len(r) - n]) for r in rows], [tail] * len(rows),
                        part.examples[i].gold)
    without, full = rows
    n = _shared([without, full])
    return Rendered([keep(full[:n])], [full[n:].copy()], -1)


@torch.no_grad()
def correct(model: torch.nn.Module, r: Rendered, block_size: int, device: torch.device,
            autocast=contextlib.nullcontext) -> bool:
    """Whether the model answers the example right: one forward of its rows."""
    rows = [np.concatenate([h, t])[-block_size:] for h, t in zip(r.heads, r.tails)]
    scored = [min(len(t), len(row) - 1) for t, row in zip(r.tails, rows)]
    width = max(len(row) for row in rows)
    inputs = torch.zeros(len(rows), width, dtype=torch.long)
    for k, row in enumerate(rows):
        inputs[k, :len(row)] = torch.from_numpy(row.astype(np.int64))
    inputs = inputs.to(device)
    with autocast():
        logits, _ = model(inputs)  # (rows, width, V)
    if r.gold < 0:  # language modeling: the greedy token at every position of the tail
        end, n = len(rows[0]), scored[0]
        guess = logits[0, end - 1 - n:end - 1].argmax(-1)  # (n,)
        return bool(torch.equal(guess, inputs[0, end - n:end]))
    if min(scored) == 0:  # a choice with no tokens of its own: no mean compares it
        return False  # (after the forward: every rank runs the same ones)
    targets = torch.full((len(rows), width), -1, dtype=torch.long, device=device)
    for k, (row, n) in enumerate(zip(rows, scored)):
        targets[k, len(row) - n:len(row)] = inputs[k, len(row) - n:len(row)]
    losses = F.cross_entropy(logits[:, :-1].float().flatten(0, 1), targets[:, 1:].flatten(),
                             ignore_index=-1, reduction="none").view(len(rows), -1)  # (rows, w-1)
    means = losses.double().sum(1) / torch.tensor(scored, dtype=torch.float64, device=device)
    return int(means.argmin().item()) == r.gold  # the first of equal means, as torch's argmin


def centered(acc: float, baseline: float) -> float:
    """Accuracy rescaled so that chance (`baseline`, percent) is 0 and all right is 1."""
    return (acc - 0.01 * baseline) / (1 - 0.01 * baseline)


class CoreScorer:
    """A bundle's tasks (task.examples: bundle.Part), this rank holding its rendered share."""

    def __init__(self, task, tokenizer, block_size: int, env: DistEnv):
        if tokenizer.eot_id is None:
            raise UserError(f"{task.source}: CORE starts every prompt with the tokenizer's "
                            "end-of-text (its BOS), and this tokenizer has none")
        self.env, self.block_size, self.parts = env, block_size, task.examples
        everything = [(p, i) for p, part in enumerate(self.parts)
                      for i in range(len(part.examples))]
        self.size = len(everything)
        mine = everything[env.rank::env.world_size] or everything[:1]  # a rank without any
        self.share = []                                                 # repeats the first
        for p, part in enumerate(self.parts):
            indices = [i for q, i in mine if q == p]
            self.share += [(p, r) for r in render(part, indices, tokenizer, block_size)]

    def score(self, model: torch.nn.Module, autocast=contextlib.nullcontext,
              bar: str | bool = False) -> dict:
        """{metric: CORE, n, PART_acc, PART_centered, PART_n for each task}: collective (one
        all-reduce). Call it on the unwrapped model, on every rank, in eval mode."""
        env = self.env
        mine = len(range(env.rank, self.size, env.world_size))  # examples this rank counts
        right = torch.zeros(len(self.parts), dtype=torch.float64, device=env.device)
        steps = range(math.ceil(self.size / env.world_size))  # the same forwards on every rank
        if bar and env.is_main:
            steps = progress.bar(steps, desc=bar, unit="example")
        for k in steps:
            p, r = self.share[k] if k < mine else self.share[0]
            hit = correct(model, r, self.block_size, env.device, autocast)
            if k < mine:
                right[p] += hit
        right = collectives.all_reduce(env, right).tolist()
        out, scores = {}, []
        for part, count in zip(self.parts, right):
            n = len(part.examples)
            scores.append(centered(count / n, part.baseline))
            out.update({f"{part.label}_acc": count / n, f"{part.label}_centered": scores[-1],
                        f"{part.label}_n": n})
        return {"metric": sum(scores) / len(scores), "n": self.size, **out}

"""A second kind of eval task, whole: its line parser, its scorer and its row of the kind table,
added from outside the package. A task of this kind is a jsonl of {"text": ...} lines, scored by
the mean cross-entropy per token of each text given what comes before it in the text (its last
block_size + 1 tokens): `nll`. Run as `python -m tests.e2e.toy_task train|eval ...`: the row is
registered, then ddpgpt's own command line runs, so `--task toy:NAME` and `run.eval_tasks`
reach the task loader, the scorer, metrics.jsonl, the progress line and `eval`'s report like the
built-in kind."""

import json
import sys

import torch
import torch.nn.functional as F

from ddpgpt.distributed import collectives
from ddpgpt.errors import DataError
from ddpgpt.evals.kinds import KINDS, Kind


def parse(line: str, where: str) -> str:
    """One line: {"text": a non-empty string}."""
    try:
        row = json.loads(line)
    except ValueError as e:
        raise DataError(f"{where}: not JSON ({e})") from None
    if not isinstance(row, dict) or not isinstance(row.get("text"), str) or not row["text"]:
        raise DataError(f'{where}: each line must be {{"text": "..."}}')
    return row["text"]


def token_rows(texts, tokenizer, block_size: int) -> list[list[int]]:
    """Each text's tokens, its last block_size + 1 kept (inputs then targets shifted by one)."""
    return [ids.tolist()[-(block_size + 1):] for ids in tokenizer.encode_batch(list(texts))]


class ToyScorer:
    """Rank r scores texts r, r + W, ...; one all-reduce of (loss sum, token count)."""

    def __init__(self, task, tokenizer, block_size: int, env):
        self.env, self.size = env, len(task.examples)
        self.rows = token_rows(task.examples[env.rank::env.world_size], tokenizer, block_size)

    @torch.no_grad()
    def score(self, model, autocast, bar) -> dict:
        totals = torch.zeros(2, dtype=torch.float64, device=self.env.device)
        for row in self.rows:
            x = torch.tensor([row[:-1]], device=self.env.device)
            y = torch.tensor([row[1:]], device=self.env.device)
            with autocast():
                logits, _ = model(x)
            totals[0] += F.cross_entropy(logits.float()[0], y[0], reduction="sum").double()
            totals[1] += y.numel()
        totals = collectives.all_reduce(self.env, totals)
        return {"nll": (totals[0] / totals[1]).item(), "n": self.size}


ROW = Kind("toy", "tests.e2e.toy_task:parse", "tests.e2e.toy_task:ToyScorer", metrics=("nll",),
           headline="nll", label="mean loss per token", row='{"text": ...}')

if __name__ == "__main__":
    KINDS[ROW.name] = ROW
    from ddpgpt.cli import main

    main(sys.argv[1:])

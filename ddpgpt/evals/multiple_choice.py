"""Multiple-choice accuracy, as llm.c's dev/data/hellaswag.py defines it for HellaSwag: the
default kind of eval task (kinds.py), and its task files' lines (`example`: one line as an
`Example`, or one line of error naming FILE:LINE).

For each ending, the context's tokens then the tokens of " " + ending (no end-of-text token
first) go through the model; the ending's tokens are scored by their cross-entropy given
everything before them. The ending with the lowest mean per-token loss is the prediction of
`acc_norm`, the lowest sum that of `acc` (GPT-2 124M: 0.2955 and 0.2859 on HellaSwag's
validation set, as llm.c reports). `acc_char` divides the sum by the ending's length in
characters instead, which is how lm-evaluation-harness normalizes its acc_norm (0.3114 for GPT-2
124M there; its HellaSwag also cleans the text first, which is not done here). A context and
ending longer than the model's block keep their last block_size tokens.

Any number of processes: rank r scores examples r, r + W, r + 2W, ...; one all-reduce sums the
counts, so the result is the same at any W. Each example is one forward of its endings (a batch
of E rows, padded to the longest), whatever W is: the losses do not depend on what else is in a
batch. Every rank runs the same number of forwards (a rank short of examples repeats one
without counting it), so a sharded model whose forward gathers parameters (fsdp2) cannot hang.
"""

from __future__ import annotations

import contextlib
import json
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ddpgpt import progress
from ddpgpt.distributed import collectives
from ddpgpt.distributed.group import DistEnv
from ddpgpt.errors import DataError
from ddpgpt.evals.tasks import Task


@dataclass(frozen=True)
class Example:
    """One question: the context, its candidate endings and the index of the right one."""
    ctx: str
    endings: tuple[str, ...]
    label: int


def example(line: str, where: str) -> Example:
    """One line as an Example, or one line of error naming FILE:LINE."""
    def bad(what: str) -> DataError:
        return DataError(f"{where}: {what}; each line must be "
                         '{"ctx": "...", "endings": ["...", ...], "label": INDEX}')
    try:
        row = json.loads(line)
    except ValueError as e:
        raise bad(f"not JSON ({e})") from None
    if not isinstance(row, dict):
        raise bad(f"a JSON {type(row).__name__}, not an object")
    missing = [k for k in ("ctx", "endings", "label") if k not in row]
    if missing:
        raise bad(f"missing field {', '.join(missing)}")
    ctx, endings, label = row["ctx"], row["endings"], row["label"]
    if not isinstance(ctx, str):
        raise bad(f"ctx is a {type(ctx).__name__}, not a string")
    if not ctx.strip():
        raise bad("ctx is empty (the endings are scored given it)")
    if not isinstance(endings, list) or len(endings) < 2 or \
            not all(isinstance(e, str) for e in endings):
        raise bad("endings must be a list of at least 2 strings")
    empty = [i for i, e in enumerate(endings) if not e.strip()]
    if empty:
        raise bad(f"ending {empty[0]} is empty")
    # bool is an int in Python; a label of true is a mistake, not index 1. HellaSwag's own
    # files hold the label as an int; a string of digits is accepted as the same index.
    if isinstance(label, str) and label.isascii() and label.isdigit():  # not "²": no index
        label = int(label)
    if isinstance(label, bool) or not isinstance(label, int) or not 0 <= label < len(endings):
        raise bad(f"label {label!r} is not an index into the {len(endings)} endings "
                  f"(0 to {len(endings) - 1})")
    return Example(ctx, tuple(endings), label)


@dataclass
class Rendered:
    """One example ready for the model: every ending's row."""
    inputs: torch.Tensor   # (E, L) token ids, padded with 0
    targets: torch.Tensor  # (E, L) the ending's tokens where they are predicted, -1 elsewhere
    label: int
    chars: tuple[int, ...]  # each ending's length in characters (acc_char)


def render(example: Example, tokenizer, block_size: int) -> Rendered:
    """Context tokens then " " + ending tokens, one row per ending, the last block_size tokens
    of each kept; inputs are a row's tokens but the last, targets its tokens but the first."""
    ctx, *endings = tokenizer.encode_batch([example.ctx, *(" " + e for e in example.endings)])
    return rows_of(ctx.tolist(), [end.tolist() for end in endings], example, block_size)


def rows_of(ctx: list[int], endings: list[list[int]], example: Example,
            block_size: int) -> Rendered:
    """The rows of a context's tokens then each ending's (the last block_size tokens of each),
    the endings' tokens scored."""
    rows = []
    for end in endings:
        tokens = [*ctx, *end][-block_size:]
        scored = min(len(end), len(tokens) - 1)  # the first token kept has no prediction
        unscored = len(tokens) - 1 - scored
        rows.append((tokens[:-1], [-1] * unscored + tokens[unscored + 1:]))
    width = max(len(inputs) for inputs, _ in rows)
    inputs = torch.tensor([x + [0] * (width - len(x)) for x, _ in rows], dtype=torch.long)
    targets = torch.tensor([y + [-1] * (width - len(y)) for _, y in rows], dtype=torch.long)
    return Rendered(inputs, targets, example.label, tuple(len(e) for e in example.endings))


@torch.no_grad()
def ending_losses(model: torch.nn.Module, r: Rendered, device: torch.device,
                  autocast=contextlib.nullcontext) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum, count) of each ending's per-token cross-entropy, float64, shape (E,)."""
    inputs, targets = r.inputs.to(device), r.targets.to(device)
    with autocast():
        logits, _ = model(inputs)  # (E, L, V)
    losses = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=-1,
                             reduction="none").view(targets.shape)  # (E, L), 0 where ignored
    return losses.double().sum(1), (targets >= 0).sum(1)


def correct(sums: torch.Tensor, counts: torch.Tensor, r: Rendered) -> tuple[int, int, int]:
    """(acc_norm, acc, acc_char) of one example: 1 where that rule picks the label. A tie goes
    to the first ending, as torch's argmin (and llm.c's) does."""
    chars = torch.tensor(r.chars, dtype=torch.float64, device=sums.device)
    picks = ((sums / counts).argmin(), sums.argmin(), (sums / chars).argmin())
    return tuple(int(p.item() == r.label) for p in picks)


class TaskScorer:
    """One task, this rank holding its rendered share (rendered once; scored at every evaluation
    during training). `render`: how an example becomes its rows (a subclass may render it in
    another format: evals/chat_choice.py)."""

    render = staticmethod(render)

    def __init__(self, task: Task, tokenizer, block_size: int, env: DistEnv):
        self.env, self.size = env, len(task.examples)
        mine = task.examples[env.rank::env.world_size]
        # A rank without examples renders the first one for its uncounted forwards.
        self.share = [self.render(e, tokenizer, block_size) for e in (mine or task.examples[:1])]

    def score(self, model: torch.nn.Module, autocast=contextlib.nullcontext,
              bar: str | bool = False) -> dict:
        """{acc_norm, acc, acc_char, n}: collective (one all-reduce). Call it on the unwrapped
        model, on every rank, in eval mode. `bar`: a progress bar on rank 0, named so."""
        env = self.env
        mine = len(range(env.rank, self.size, env.world_size))  # examples this rank counts
        totals = torch.zeros(4, dtype=torch.float64, device=env.device)  # norm, sum, char, n
        steps = range(math.ceil(self.size / env.world_size))  # the same forwards on every rank
        if bar and env.is_main:
            steps = progress.bar(steps, desc=bar, unit="question")
        for i in steps:
            r = self.share[i] if i < mine else self.share[0]
            sums, lengths = ending_losses(model, r, env.device, autocast)
            if i < mine:
                totals += torch.tensor([*correct(sums, lengths, r), 1], dtype=torch.float64,
                                       device=env.device)
        counts = collectives.all_reduce(env, totals)
        n = int(counts[3].item())
        return {"acc_norm": counts[0].item() / n, "acc": counts[1].item() / n,
                "acc_char": counts[2].item() / n, "n": n}

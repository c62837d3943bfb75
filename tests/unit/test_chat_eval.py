"""Evaluating a fine-tune on conversations, in one process: the val loss over the assistant's
tokens (against a one-forward oracle), and multiple choice in the chat format (the question the
user's turn, each choice the assistant's reply: against an oracle of each reply's loss), both
the same when W ranks share the work (ranks simulated here: each rank's totals summed as the
one all-reduce sums them)."""

import pytest
import torch
import torch.nn.functional as F

from ddpgpt.config.model import ModelConfig
from ddpgpt.data import chat
from ddpgpt.data.loader import EvalLoader
from ddpgpt.data.shards import TokenDataset
from ddpgpt.data.tokenizer import ByteTokenizer, ChatTokens
from ddpgpt.distributed import collectives
from ddpgpt.distributed.group import DistEnv
from ddpgpt.errors import ChatError
from ddpgpt.evals import chat_choice
from ddpgpt.evals.loss import evaluate
from ddpgpt.evals.multiple_choice import Example
from ddpgpt.evals.tasks import Task
from ddpgpt.model.gpt import GPT

TOK = ChatTokens(ByteTokenizer())
MODEL = ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=32, vocab_size=263,
                    arch="modern", doc_mask=True, bos_id=256)
EXAMPLES = tuple(Example(f"What is {a}+{b}?", (f"{a + b}.", f"{a + b + 1}.", "No idea."), i % 3)
                 for i, (a, b) in enumerate([(1, 2), (30, 4), (7, 7), (12, 9), (50, 5)]))


@pytest.fixture(scope="module")
def model():
    net = GPT(MODEL, seed=3)
    with torch.no_grad():
        for p in net.parameters():  # away from init's zeros: choices then score differently
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(4)) * 0.2)
    return net.eval()


def as_ranks(world: int, run) -> list:
    """What `run(env)` returns on each of `world` simulated ranks, with every all-reduce the
    sum of what each rank reduces (run once per rank to collect, then again to read)."""
    reduced, real = [], collectives.all_reduce
    try:
        collectives.all_reduce = lambda env, t, op="sum": (reduced.append(t.clone()), t)[1]
        for r in range(world):
            run(DistEnv(rank=r, world_size=world))
        total = torch.stack(reduced).sum(0)
        collectives.all_reduce = lambda env, t, op="sum": t.copy_(total)
        return [run(DistEnv(rank=r, world_size=world)) for r in range(world)]
    finally:
        collectives.all_reduce = real


def test_the_val_loss_is_the_assistants_tokens_loss_at_any_w(chat_data, model):
    ds = TokenDataset(chat_data)
    full = EvalLoader(ds, seq_len=32, micro_batch=4, align="bos")
    x = torch.cat([b[0] for b in full])
    y = torch.cat([b[1] for b in full])
    with torch.no_grad():
        logits, _ = model(x)
    want = (F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-1,
                            reduction="sum") / (y >= 0).sum()).item()
    assert (y >= 0).float().mean() < 0.6  # the user's turns and the padding are not scored
    assert evaluate(model, full, DistEnv()) == pytest.approx(want, rel=1e-6)
    for world in (2, 3):
        got = as_ranks(world, lambda env: evaluate(model, EvalLoader(
            ds, seq_len=32, micro_batch=4, align="bos", rank=env.rank,
            world_size=env.world_size), env))
        assert got == pytest.approx([want] * world, rel=1e-6)


def reply_loss(model, example: Example, k: int) -> tuple[float, int]:
    """Choice k's summed loss over its reply tokens and <|assistant_end|>, and their count."""
    prompt = chat.prompt([{"role": "user", "content": example.ctx}], TOK.encode_batch,
                         TOK.special, 256).tolist()
    reply = [*TOK.encode_batch([example.endings[k]])[0].tolist(), TOK.special["<|assistant_end|>"]]
    ids = torch.tensor([prompt + reply])
    with torch.no_grad():
        logits = model(ids[:, :-1])[0][0, len(prompt) - 1:]
    return F.cross_entropy(logits, ids[0, len(prompt):], reduction="sum").item(), len(reply)


def test_chat_multiple_choice_scores_each_choice_as_the_reply_at_any_w(model):
    task = Task("sums", "", EXAMPLES, "chat")
    want = [0, 0, 0]
    for e in EXAMPLES:
        losses = [reply_loss(model, e, k) for k in range(3)]
        norm = min(range(3), key=lambda k: losses[k][0] / losses[k][1])
        total = min(range(3), key=lambda k: losses[k][0])
        char = min(range(3), key=lambda k: losses[k][0] / len(e.endings[k]))
        want = [w + (pick == e.label) for w, pick in zip(want, (norm, total, char))]
    expected = {"acc_norm": want[0] / 5, "acc": want[1] / 5, "acc_char": want[2] / 5, "n": 5}
    for world in (1, 2, 3):
        got = as_ranks(world, lambda env: chat_choice.ChatScorer(task, TOK, 32, env).score(model))
        assert got == [expected] * world


def test_a_model_without_the_template_cannot_be_asked_in_it():
    with pytest.raises(ChatError) as e:
        chat_choice.render(EXAMPLES[0], ByteTokenizer(), 32)
    assert str(e.value) == ("a task in the chat format (chat:NAME) needs a model fine-tuned on "
                            "conversations; this one's tokenizer has no <|system_start|> (no chat "
                            "template): score it with --task NAME")

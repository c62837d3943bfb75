"""Multiple choice in the chat format (task kind `chat`: `--task chat:NAME --task-data FILE`,
run.eval_tasks chat:NAME): a fine-tuned model is asked as it was trained. The same task files
and scores as multiple_choice.py (acc_norm, acc, acc_char), rendered by the chat template
(data/chat.py): the question is the user's turn and each choice the assistant's reply,

    <|endoftext|><|user_start|> ctx <|user_end|><|assistant_start|> ending <|assistant_end|>

the reply's tokens and its <|assistant_end|> scored (the tokens the fine-tune's mask trains),
given the conversation before them. Scored as the default kind is, rank r its examples r, r + W,
... and one all-reduce: the same at any W. A model whose tokenizer has no chat template is one
line.
"""

from __future__ import annotations

from ddpgpt.data import chat
from ddpgpt.errors import ChatError
from ddpgpt.evals.multiple_choice import Example, Rendered, TaskScorer, rows_of


def render(example: Example, tokenizer, block_size: int) -> Rendered:
    """One row per choice: the question as the user's turn, the choice as the reply."""
    missing = chat.missing(tokenizer.special)
    if missing:
        raise ChatError(f"a task in the chat format (chat:NAME) needs a model fine-tuned on "
                        f"conversations; this one's tokenizer has no {missing[0]} (no chat "
                        "template): score it with --task NAME")
    ids, end = tokenizer.special, tokenizer.special["<|assistant_end|>"]
    ctx = chat.prompt([{"role": "user", "content": example.ctx}], tokenizer.encode_batch, ids,
                      tokenizer.eot_id).tolist()
    endings = [[*e.tolist(), end] for e in tokenizer.encode_batch(list(example.endings))]
    return rows_of(ctx, endings, example, block_size)


class ChatScorer(TaskScorer):
    render = staticmethod(render)

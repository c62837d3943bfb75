"""Conversations as tokens: the chat template, its special tokens, and the loss mask.

A conversation is a record's `messages`, a list of {"role", "content"} (role system, user or
assistant; the layout of the hub's chat sets). It is rendered as one document:

    <|endoftext|> <|user_start|> What does json.dumps do? <|user_end|>
                  <|assistant_start|> Serialize obj to a JSON formatted str. <|assistant_end|> ...

each message its role's start token, its content's tokens (encoded alone, as ordinary text),
its role's end token; a system message likewise with <|system_start|> and <|system_end|>. The
end-of-text token that begins it is the document start packing and the document mask read
(data/packing.py, model/attention.py), so a conversation is packed and attended to whole.

The loss mask is 1 on the tokens an assistant turn is trained to produce: its content's tokens
and its <|assistant_end|> (so the model learns to end its turn), 0 elsewhere (the end-of-text,
every role's start token, the system's and the user's turns). The prompt for a reply is the
conversation so far followed by <|assistant_start|>; a reply ends at <|assistant_end|>.

`JINJA` is the same template in transformers' chat_template language: an exported tokenizer's
`apply_chat_template(messages, add_generation_prompt=True)` gives exactly `prompt`'s ids
(tests/unit/test_chat_export.py renders both). The six tokens are real tokens of the tokenizer,
never text: a content that spells one is not a conversation (it would render as the token).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import numpy as np

TEMPLATE = "ddpgpt-chat-1"  # meta.json's "chat": what a dataset's conversations were rendered by
ROLES = ("system", "user", "assistant")
TOKENS = tuple(f"<|{role}_{edge}|>" for role in ROLES for edge in ("start", "end"))
BOS = "<|endoftext|>"  # tokenizer.EOT_TEXT: every document starts with it
JINJA = ("{{ '<|endoftext|>' }}{% for message in messages %}"
         "{{ '<|' + message['role'] + '_start|>' + message['content'] + '<|' + message['role']"
         " + '_end|>' }}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant_start|>' }}"
         "{% endif %}")

# Why a record is not a conversation: UnitStats' counter of each, and the words that say it.
REASONS = {"chat_malformed": "not a list of {role, content} messages with text content",
           "chat_unknown_role": "a role other than system, user or assistant",
           "chat_empty": "a message with empty content",
           "chat_no_assistant": "no assistant turn"}


@dataclass(frozen=True)
class Reading:
    """How prepare reads conversations (picklable: workers receive it). `strict`: a record that
    is not a conversation stops the prepare (its one line), else it is counted and skipped."""

    strict: bool = False


class NotConversation(ValueError):
    """A record that cannot be a conversation: `key` is its REASONS counter."""

    def __init__(self, key: str, detail: str):
        super().__init__(detail)
        self.key = key


def messages(value) -> list[dict]:
    """`value` as a conversation's messages ({"role", "content"} with text), or
    NotConversation saying why not."""
    if not isinstance(value, list | tuple) or not value:
        raise NotConversation("chat_malformed", f"messages is {type(value).__name__}, not a "
                              "list of messages" if not isinstance(value, list | tuple) else
                              "messages is an empty list")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or \
                not isinstance(m.get("content"), str):
            raise NotConversation("chat_malformed", f"message {i} is not an object with text "
                                  "role and content")
        if m["role"] not in ROLES:
            raise NotConversation("chat_unknown_role", f"message {i} has role {m['role']!r} "
                                  f"(the template knows {', '.join(ROLES)})")
        if not m["content"].strip():
            raise NotConversation("chat_empty", f"message {i} ({m['role']}) has empty content")
        spelled = [t for t in (*TOKENS, BOS) if t in m["content"]]
        if spelled:
            raise NotConversation("chat_malformed", f"message {i} spells the template token "
                                  f"{spelled[0]} in its content")
        out.append({"role": m["role"], "content": m["content"]})
    if not any(m["role"] == "assistant" for m in out):
        raise NotConversation("chat_no_assistant", "no assistant turn")
    return out


def conversations(records: Iterable[tuple[str, object]], stats, reading: Reading,
                  error: Callable[[str], Exception]) -> Iterator[list[dict]]:
    """The conversations of (where, value) records; the others counted in `stats` (REASONS'
    counters), or, `strict`, `error(line)` raised for the first."""
    for where, value in records:
        try:
            yield messages(value)
        except NotConversation as e:
            if reading.strict:
                raise error(f"{where}: not a conversation: {e}; fix the record, or drop "
                            "--strict to count and skip such records") from None
            setattr(stats, e.key, getattr(stats, e.key) + 1)


def render(convs: list[list[dict]], encode: Callable[[list[str]], list[np.ndarray]],
           ids: dict[str, int], bos: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each conversation's (tokens, mask), uint32 and uint8 of one length: see the module
    docstring. `encode`: a tokenizer's encode_batch (the contents, in one call); `ids`: its
    template tokens' ids; `bos`: its end-of-text id."""
    contents = encode([m["content"] for conv in convs for m in conv])
    out, k = [], 0
    for conv in convs:
        tokens, mask = [np.array([bos], dtype=np.uint32)], [np.zeros(1, dtype=np.uint8)]
        for m in conv:
            body = contents[k].astype(np.uint32)
            k += 1
            trained = m["role"] == "assistant"
            tokens += [np.array([ids[f"<|{m['role']}_start|>"]], dtype=np.uint32), body,
                       np.array([ids[f"<|{m['role']}_end|>"]], dtype=np.uint32)]
            mask += [np.zeros(1, dtype=np.uint8), np.full(len(body) + 1, trained, np.uint8)]
        out.append((np.concatenate(tokens), np.concatenate(mask)))
    return out


def prompt(conv: list[dict], encode: Callable[[list[str]], list[np.ndarray]],
           ids: dict[str, int], bos: int) -> np.ndarray:
    """The ids a reply to `conv` (its last message the user's) is generated from: the
    conversation rendered, then <|assistant_start|> (JINJA with add_generation_prompt)."""
    tokens = render([conv], encode, ids, bos)[0][0]
    return np.append(tokens, np.uint32(ids["<|assistant_start|>"]))


def missing(ids: dict[str, int]) -> list[str]:
    """The template's tokens a tokenizer's `special` ids lack."""
    return [t for t in TOKENS if t not in ids]


def fit(conv: list[dict], encode: Callable[[list[str]], list[np.ndarray]], ids: dict[str, int],
        bos: int, room: int) -> tuple[list[dict], np.ndarray, bool]:
    """The conversation cut to what fits `room` tokens of prompt (a reply's room left of the
    model's context): its oldest exchanges dropped, a system message kept, until the prompt
    fits or only the last user turn (and the system message) is left. Returns (the messages
    kept, their prompt, whether any was dropped)."""
    system = conv[:1] if conv and conv[0]["role"] == "system" else []
    turns = conv[len(system):]
    dropped = False
    while True:
        ids_ = prompt(system + turns, encode, ids, bos)
        users = [i for i, m in enumerate(turns) if m["role"] == "user"]
        if len(ids_) <= room or len(users) <= 1:
            return system + turns, ids_, dropped
        turns, dropped = turns[users[1]:], True  # from the second user turn on

"""`ddpgpt chat` in one process: from a pipe one reply a line, each the model's greedy reply to
the conversation rendered by the template (against a forward over the whole context, no cache),
multi-turn, the oldest turns dropped when the context is full (said once), a system message
kept; a model without the template is one line."""

import io

import pytest
import torch

from ddpgpt.commands import chat as command
from ddpgpt.config.commands import ChatConfig
from ddpgpt.config.model import ModelConfig
from ddpgpt.data import chat
from ddpgpt.data.tokenizer import ByteTokenizer, ChatTokens
from ddpgpt.errors import ChatError
from tests.helpers import assert_greedy_agrees, write_run

MODEL = ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=64, vocab_size=263, arch="modern")
TOK = ChatTokens(ByteTokenizer())
END = TOK.special["<|assistant_end|>"]


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("sft") / "run"
    write_run(run, MODEL, "byte+chat", 263)
    return run


def chat_from_pipe(monkeypatch, capsys, lines: str, **cfg):
    monkeypatch.setattr("sys.stdin", io.StringIO(lines))
    talks = []
    real = command.Talk

    class Recorded(real):
        def __init__(self, *args):
            super().__init__(*args)
            self.turns = []
            talks.append(self)

        def reply(self, messages):
            yield from super().reply(messages)
            self.turns.append((self.prompt_ids, self.drawn))

        def prompt(self, messages):
            self.prompt_ids = super().prompt(messages)
            return self.prompt_ids

    monkeypatch.setattr(command, "Talk", Recorded)
    command.run(ChatConfig(device="cpu", threads=1, **cfg))
    out = capsys.readouterr()
    return out.out.splitlines(), out.err, talks[0]


def greedy(model, ids: list[int], n: int) -> list[int]:
    """The greedy reply by full forwards over the context, no cache, to the first stop."""
    out = []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids + out]))[0][0, -1, :263]
            token = int(logits.argmax())
            if token in (END, TOK.eot_id):
                break
            out.append(token)
    return out


def test_from_a_pipe_each_line_is_a_turn_and_each_reply_the_greedy_one(sft_run, monkeypatch,
                                                                         capsys):
    from ddpgpt.checkpoint.read import load_model
    from ddpgpt.run.run_dir import RunDir

    lines, _, talk = chat_from_pipe(monkeypatch, capsys, "hi\n\nwhat now?\n",
                                    run_dir=str(sft_run), temperature=0, max_new_tokens=8,
                                    system="be brief")
    assert len(lines) == 2 and len(talk.turns) == 2  # the empty line is no turn
    model, _ = load_model(RunDir(sft_run), "cpu")
    first, second = talk.turns
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert first[0] == chat.prompt(messages, TOK.encode_batch, TOK.special, 256).tolist()
    messages += [{"role": "assistant", "content": TOK.decode(first[1]) or " "},
                 {"role": "user", "content": "what now?"}]
    assert second[0] == chat.prompt(messages, TOK.encode_batch, TOK.special, 256).tolist()
    for prompt, drawn in talk.turns:
        want = greedy(model, prompt, 8)
        n = min(len(want), len(drawn))
        assert_greedy_agrees([prompt + drawn[:n]], [prompt + want[:n]],
                             lambda p: model(p)[0][:, -1, :263])
        assert lines[talk.turns.index((prompt, drawn))] == TOK.decode(drawn)


def test_the_oldest_turns_are_dropped_when_the_context_is_full(sft_run, monkeypatch, capsys):
    turns = "".join(f"question number {i}\n" for i in range(4))
    lines, err, talk = chat_from_pipe(monkeypatch, capsys, turns, run_dir=str(sft_run),
                                      temperature=0, max_new_tokens=16, system="s")
    assert len(lines) == 4
    assert all(len(prompt) <= 64 - 16 for prompt, _ in talk.turns)
    assert err.count("oldest turns are dropped") == 1  # said once
    assert err.strip() == ("ddpgpt chat: the conversation outgrew the model's context (48 tokens "
                           "and 16 for a reply): its oldest turns are dropped from here on")
    last = TOK.decode(talk.turns[-1][0])
    assert last.startswith("<|endoftext|><|system_start|>s<|system_end|>")  # kept
    assert "question number 3" in last and "question number 0" not in last


def test_fit_keeps_the_system_message_and_drops_whole_exchanges():
    conv = [{"role": "system", "content": "s"}]
    for i in range(3):
        conv += [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]
    conv.append({"role": "user", "content": "q3"})
    full = len(chat.prompt(conv, TOK.encode_batch, TOK.special, 256))
    kept, ids, dropped = chat.fit(conv, TOK.encode_batch, TOK.special, 256, full)
    assert (kept, dropped) == (conv, False)
    kept, ids, dropped = chat.fit(conv, TOK.encode_batch, TOK.special, 256, full - 1)
    assert (kept, dropped) == ([conv[0], *conv[3:]], True)  # q0 and its answer went
    kept, ids, _ = chat.fit(conv, TOK.encode_batch, TOK.special, 256, 1)
    assert kept == [conv[0], conv[-1]]  # the last turn stays, whatever its length
    assert ids.tolist() == chat.prompt(kept, TOK.encode_batch, TOK.special, 256).tolist()


def test_a_model_not_fine_tuned_on_conversations_is_one_line(tmp_path):
    run = tmp_path / "base"
    write_run(run, ModelConfig(n_layer=1, n_head=2, n_embd=32, block_size=16, vocab_size=257),
              "byte", 257)
    with pytest.raises(ChatError) as e:
        command.run(ChatConfig(run_dir=str(run), device="cpu"))
    assert str(e.value) == (
        f"run {run} (step 3): its tokenizer has no <|system_start|> (no chat template): the "
        "model was not fine-tuned on conversations; fine-tune it: ddpgpt prepare CHATS.jsonl "
        f"--chat --tokenizer-from {run} --out data/chat, then ddpgpt train --data data/chat "
        f"--init-from {run}")

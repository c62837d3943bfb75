"""`ddpgpt export` of a run fine-tuned on conversations, read back by transformers: the
tokenizer's chat template renders exactly the ids `ddpgpt chat` feeds the model (byte+chat,
a bpe with the template's tokens, gpt2+chat), and greedy `generate` draws `ddpgpt chat
--temperature 0`'s reply token for token."""

import io

import pytest
import torch

from ddpgpt.commands import chat as command
from ddpgpt.commands import export
from ddpgpt.config.commands import ChatConfig, ExportConfig
from ddpgpt.config.model import ModelConfig
from ddpgpt.data import chat
from ddpgpt.data.tokenizer import BPETokenizer, load_tokenizer
from tests.helpers import TIKTOKEN_GPT2, assert_greedy_agrees, write_run

transformers = pytest.importorskip("transformers")

CONVERSATIONS = [
    [{"role": "user", "content": "What does json.dumps do?"}],
    [{"role": "system", "content": "Answer in one line."},
     {"role": "user", "content": "Qu'est-ce que  ça fait ? ✓"},
     {"role": "assistant", "content": " Il sérialise.\n"},
     {"role": "user", "content": "And json.loads?"}],
]


def sft_run(tmp_path, kind: str) -> tuple:
    """A run fine-tuned on conversations, of tokenizer `kind` (a bpe's tokenizer.json with the
    template's tokens reserved, as prepare --chat trains it), exported."""
    run = tmp_path / kind
    run.mkdir()
    if kind == "bpe":
        texts = ["json.dumps serializes obj to a JSON formatted str. " * 4, "ça fait ✓ " * 8]
        BPETokenizer.train(texts, 300, False, reserved=chat.TOKENS).save(run)
    tok = load_tokenizer(run, kind)
    rows = 50304 if kind.startswith("gpt2") else tok.vocab_size
    write_run(run, ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=64, vocab_size=rows,
                               vocab_limit=tok.vocab_size if rows != tok.vocab_size else 0,
                               arch="modern"), kind, tok.vocab_size)
    out = tmp_path / f"{kind}-export"
    export.run(ExportConfig(run_dir=str(run), out=str(out)))
    return run, out, tok


@pytest.mark.parametrize("kind", ["byte+chat", "bpe", "gpt2+chat"])
def test_the_exported_template_renders_the_ids_chat_feeds_and_generate_replies_alike(
        tmp_path, kind, monkeypatch, capsys):
    if kind.startswith("gpt2") and not TIKTOKEN_GPT2.is_dir():
        pytest.skip("GPT-2's tokenizer files are not here")
    run, out, tok = sft_run(tmp_path, kind)
    capsys.readouterr()  # export's line
    theirs = transformers.AutoTokenizer.from_pretrained(out)
    for conv in CONVERSATIONS:
        ids = theirs.apply_chat_template(conv, add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        assert list(ids) == chat.prompt(conv, tok.encode_batch, tok.special,
                                        tok.eot_id).tolist()
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    monkeypatch.setattr("sys.stdin", io.StringIO(CONVERSATIONS[0][0]["content"] + "\n"))
    talks = []

    class Seen(command.Talk):
        def __init__(self, *args):
            super().__init__(*args)
            talks.append(self)

    monkeypatch.setattr(command, "Talk", Seen)
    command.run(ChatConfig(run_dir=str(run), temperature=0, max_new_tokens=12, device="cpu",
                           threads=1))
    prompt = chat.prompt(CONVERSATIONS[0], tok.encode_batch, tok.special, tok.eot_id).tolist()
    with torch.no_grad():
        made = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)
    drawn = made[0, len(prompt):].tolist()
    stops = {tok.special["<|assistant_end|>"], tok.eot_id}
    want = drawn[:next((i for i, t in enumerate(drawn) if t in stops), len(drawn))]
    mine = talks[0].drawn
    assert len(want) >= 4  # a reply to compare, not an end at once
    n = min(len(mine), len(want))
    assert_greedy_agrees([prompt + mine[:n]], [prompt + want[:n]],
                         lambda p: model(p).logits[:, -1, :].float())
    assert capsys.readouterr().out == tok.decode(mine) + "\n"
    monkeypatch.setattr("sys.stdin", io.StringIO(CONVERSATIONS[0][0]["content"] + "\n"))
    command.run(ChatConfig(init_from=str(out), temperature=0, max_new_tokens=12, device="cpu",
                           threads=1))  # the export, read back as ddpgpt's model: the same
    assert_greedy_agrees([prompt + talks[1].drawn[:n]], [prompt + mine[:n]],
                         lambda p: model(p).logits[:, -1, :].float())

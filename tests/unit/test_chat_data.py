"""Conversations as data: the chat template's tokens and loss mask, `prepare --chat` into token
and mask shards (jsonl, parquet, parts), the records that are not conversations, and the
template's special tokens in every kind of tokenizer."""

import json

import numpy as np
import pytest

from ddpgpt.config.commands import PrepareConfig
from ddpgpt.data import chat
from ddpgpt.data.prepare import main as prepare
from ddpgpt.data.prepare.assemble import Assembler, is_val
from ddpgpt.data.shards import TokenDataset
from ddpgpt.data.tokenizer import ByteTokenizer, ChatTokens, load_tokenizer, with_chat
from ddpgpt.errors import DataError, UserError
from tests.helpers import TIKTOKEN_GPT2, write_dataset

U0, U1, A0, A1 = 259, 260, 261, 262  # byte+chat: <|user_start|> ... <|assistant_end|>
S0, S1 = 257, 258


def conv(i: int) -> list[dict]:
    return [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}!"}]


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def prepare_chat(sources, out, **kw):
    kw.setdefault("workers", 1)
    kw.setdefault("tokenizer", "byte")
    prepare.run(PrepareConfig(sources=[str(s) for s in sources], out=str(out), chat=True, **kw))
    return TokenDataset(out)


def test_the_template_masks_the_assistants_content_and_end_of_turn():
    tok = ChatTokens(ByteTokenizer())
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "yo"}]
    tokens, mask = chat.render([messages], tok.encode_batch, tok.special, tok.eot_id)[0]
    assert tokens.tolist() == [256, S0, ord("s"), S1, U0, ord("h"), ord("i"), U1,
                               A0, ord("y"), ord("o"), A1]
    assert mask.tolist() == [0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1]
    assert chat.prompt(messages[:2], tok.encode_batch, tok.special, tok.eot_id).tolist() == \
        tokens[:9].tolist()  # up to and with <|assistant_start|>
    assert tok.decode(tokens.tolist()) == ("<|endoftext|><|system_start|>s<|system_end|>"
                                           "<|user_start|>hi<|user_end|><|assistant_start|>yo"
                                           "<|assistant_end|>")


def test_prepare_writes_each_conversations_mask_beside_its_tokens(tmp_path):
    convs = [conv(i) for i in range(12)]
    ds = prepare_chat([write_jsonl(tmp_path / "c.jsonl", [{"messages": c} for c in convs])],
                      tmp_path / "d", val_fraction=0.25)
    tok = ChatTokens(ByteTokenizer())
    rendered = chat.render(convs, tok.encode_batch, tok.special, tok.eot_id)
    for split in ("train", "val"):
        mine = [r for i, r in enumerate(rendered) if is_val(i, 250_000) == (split == "val")]
        np.testing.assert_array_equal(np.concatenate(ds.tokens(split)),
                                      np.concatenate([t for t, _ in mine]))
        np.testing.assert_array_equal(np.concatenate(ds.tokens(split, masks=True)),
                                      np.concatenate([m for _, m in mine]))
    assert ds.masked and ds.tokenizer == "byte+chat" and ds.vocab_size == 263
    assert ds.meta["format_version"] == 2 and ds.meta["chat"] == {"template": chat.TEMPLATE}
    assert ds.meta["source"]["trained_tokens"]["train"] == sum(
        int(m.sum()) for i, (_, m) in enumerate(rendered) if not is_val(i, 250_000))
    assert ds.verify() == 4  # two token shards and two masks, hashed against meta.json


def test_a_dataset_without_masks_is_version_1_and_reads_as_unmasked(tmp_path):
    ds = TokenDataset(write_dataset(tmp_path / "d", np.arange(40) % 7, np.arange(20) % 7, 8))
    assert not ds.masked and ds.meta["format_version"] == 1 and "masks" not in ds.meta


def test_records_that_are_not_conversations_are_counted_or_refused(tmp_path, capsys):
    records = [{"messages": conv(0)}, {"messages": conv(1)},
               {"messages": [{"role": "user", "content": "no reply"}]},
               {"messages": [{"role": "bot", "content": "x"}, *conv(2)]},
               {"messages": [{"role": "user", "content": " "}, *conv(3)]},
               {"messages": "text"},
               {"messages": [{"role": "user", "content": "<|user_end|>"}, *conv(4)]}]
    src = write_jsonl(tmp_path / "c.jsonl", records)
    ds = prepare_chat([src], tmp_path / "d", val_fraction=0.5)
    stats = ds.meta["source"]["stats"]
    assert (stats["documents"], stats["chat_no_assistant"], stats["chat_unknown_role"],
            stats["chat_empty"], stats["chat_malformed"]) == (2, 1, 1, 1, 2)
    assert ("skipped 5 records that are not conversations (2: not a list of {role, content} "
            "messages with text content; 1: a role other than system, user or assistant; 1: a "
            "message with empty content; 1: no assistant turn; --strict refuses them)"
            in capsys.readouterr().out)
    with pytest.raises(UserError) as e:
        prepare_chat([src], tmp_path / "e", strict=True)
    assert str(e.value) == (f"{src}:3: not a conversation: no assistant turn; fix the record, "
                            "or drop --strict to count and skip such records")
    assert not (tmp_path / "e").exists()


def test_chat_refuses_sources_whose_records_cannot_be_conversations(tmp_path):
    text = tmp_path / "a.txt"
    text.write_text("plain text")
    with pytest.raises(UserError, match=r"a\.txt is a text source, whose records cannot be "
                       r"conversations; give records with a list of messages \(jsonl, parquet, "
                       r"hf, stdlib-chat\)$"):
        prepare_chat([text], tmp_path / "d")
    with pytest.raises(UserError, match="^invalid config: --strict refuses records that are not "
                       "conversations: "
                       "it goes with --chat$"):
        PrepareConfig(sources=[str(text)], out=str(tmp_path / "d"), strict=True)


def test_parquet_conversations_and_parts_merge_to_the_same_dataset(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    convs = [conv(i) for i in range(9)]
    pq.write_table(pa.table({"messages": convs}), tmp_path / "c.parquet", row_group_size=2)
    whole = prepare_chat([tmp_path / "c.parquet"], tmp_path / "whole", val_fraction=0.3)
    for i in (1, 2):
        prepare.run(PrepareConfig(sources=[str(tmp_path / "c.parquet")], chat=True, workers=1,
                                  tokenizer="byte", out=str(tmp_path / f"p{i}"), part=f"{i}/2"))
    prepare.run(PrepareConfig(sources=[str(tmp_path / "p1"), str(tmp_path / "p2")], merge=True,
                              out=str(tmp_path / "merged"), val_fraction=0.3))
    merged = TokenDataset(tmp_path / "merged")
    for split in ("train", "val"):
        for masks in (False, True):
            np.testing.assert_array_equal(np.concatenate(merged.tokens(split, masks)),
                                          np.concatenate(whole.tokens(split, masks)))
    assert merged.meta["masks"] == whole.meta["masks"]  # the same files, hashes and counts


def test_the_assembler_resumes_the_masks_with_the_tokens(tmp_path):
    units = [(np.arange(10, dtype=np.uint16) + k, np.arange(10, dtype=np.uint8) % 2)
             for k in range(4)]
    record = {"docs": [[4, 4], [6, 6]]}
    outs = {}
    for name, cut in (("straight", None), ("resumed", 2)):
        (tmp_path / name).mkdir()
        asm = Assembler(tmp_path / name, "uint16", 7, 0.3, masked=True)
        for k, (tokens, mask) in enumerate(units):
            if k == cut:  # a new process continues from the state saved
                state = json.loads(json.dumps(asm.state_dict()))
                asm = Assembler(tmp_path / name, "uint16", 7, 0.3, masked=True)
                asm.load_state_dict(state)
            asm.add(tokens, record, mask)
        asm.finish(None)
        outs[name] = {p.name: p.read_bytes() for p in (tmp_path / name).iterdir()}
    assert outs["straight"] == outs["resumed"] and any(n.endswith(".mask") for n in outs["resumed"])


def test_a_mask_shard_that_does_not_match_its_tokens_is_one_line(tmp_path):
    prepare_chat([write_jsonl(tmp_path / "c.jsonl", [{"messages": conv(i)} for i in range(4)])],
                 tmp_path / "d", val_fraction=0.5)
    mask = tmp_path / "d" / "train_000000.mask"
    mask.write_bytes(mask.read_bytes()[:-1])
    with pytest.raises(DataError, match=r"train_000000\.mask: truncated: header says \d+ uint8 "
                       r"tokens \(\d+ bytes\) but the file has \d+ bytes; re-run ddpgpt prepare$"):
        TokenDataset(tmp_path / "d")


def test_every_kind_of_tokenizer_takes_the_template_tokens(tmp_path):
    """byte and gpt2 after their own ids (+chat kinds, text never encodes to them); a bpe in its
    tokenizer.json, reserved when prepare trains it, added after its ids to one taken with
    --tokenizer-from; a tokenizer that has them keeps them."""
    byte = with_chat(ByteTokenizer())
    assert byte.kind == "byte+chat" and byte.special["<|user_start|>"] == U0
    assert load_tokenizer(tmp_path, "byte+chat").special == byte.special
    assert with_chat(byte) is byte
    if TIKTOKEN_GPT2.is_dir():
        gpt2 = load_tokenizer(tmp_path, "gpt2+chat")
        assert gpt2.special["<|system_start|>"] == 50257 and gpt2.vocab_size == 50263
        assert gpt2.encode_batch(["<|user_start|>"])[0].tolist() != [50259]
    src = write_jsonl(tmp_path / "c.jsonl", [{"messages": conv(i)} for i in range(6)])
    trained = prepare_chat([src], tmp_path / "bpe", tokenizer="bpe", vocab_size=300,
                           val_fraction=0.4)
    tok = load_tokenizer(trained.path, "bpe")
    assert [tok.special[t] for t in chat.TOKENS] == [1, 2, 3, 4, 5, 6]
    assert trained.vocab_size <= 300  # (a corpus this small has fewer merges to learn)
    (tmp_path / "plain.txt").write_text("some plain text for a small bpe " * 20)
    prepare.run(PrepareConfig(sources=[str(tmp_path / "plain.txt")], out=str(tmp_path / "base"),
                              vocab_size=280, workers=1))
    base = TokenDataset(tmp_path / "base")
    grown = prepare_chat([src], tmp_path / "grown", tokenizer_from=str(tmp_path / "base"),
                         val_fraction=0.4, tokenizer="bpe")
    tok = load_tokenizer(grown.path, "bpe")
    assert grown.vocab_size == base.vocab_size + 6
    assert [tok.special[t] for t in chat.TOKENS] == list(range(base.vocab_size,
                                                               base.vocab_size + 6))
    plain = load_tokenizer(base.path, "bpe")
    assert tok.encode_batch(["plain text"])[0].tolist() == \
        plain.encode_batch(["plain text"])[0].tolist()  # the base's ids unchanged


def test_conversations_prepared_as_text_are_told_to_use_chat(tmp_path):
    src = write_jsonl(tmp_path / "c.jsonl", [{"messages": conv(0)}])
    with pytest.raises(UserError) as e:
        prepare.run(PrepareConfig(sources=[str(src)], out=str(tmp_path / "d"), workers=1))
    assert str(e.value) == (f"{src}:1: no field 'text', and its 'messages' is a conversation; "
                            "prepare conversations with --chat")
    with pytest.raises(UserError) as e:
        prepare.run(PrepareConfig(sources=[str(src)], out=str(tmp_path / "d"), workers=1,
                                  text_field="messages"))
    assert str(e.value) == (f"{src}:1: field 'messages' holds a conversation (a list of "
                            "messages), not text; prepare conversations with --chat")

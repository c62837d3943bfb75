"""The built-in conversations (`prepare stdlib-chat --chat`): questions on a standard library's
public functions, classes and methods, answered by their docstrings' summaries, parsed never
imported, split into train and val by module; on a small library written here."""

import textwrap

import numpy as np
import pytest

from ddpgpt.config.commands import PrepareConfig
from ddpgpt.data.formats import stdlib_chat
from ddpgpt.data.prepare import main as prepare
from ddpgpt.data.shards import TokenDataset
from ddpgpt.data.tokenizer import ByteTokenizer, ChatTokens
from ddpgpt.errors import UserError

LIBRARY = {
    "jsonish/__init__.py": '''
        """The package."""
        def dumps(obj):
            """Serialize obj to a JSON formatted str.

            More words that are not the summary.
            """
        def loads(s):
            """Deserialize s."""
        def _private():
            """Never asked about."""
        def undocumented():
            pass
        class Encoder:
            """Extensible JSON encoder."""
            def encode(self, o):
                """Return a JSON string representation of a Python data structure."""
            def _hidden(self):
                """No."""
    ''',
    "long.py": '''
        def wordy():
            """''' + "A first sentence that ends here. " + "word " * 80 + '''"""
    ''',
    "test/test_x.py": 'def test_a():\n    """A test, never asked about."""\n',
    "_private_mod.py": 'def f():\n    """Private module."""\n',
    "broken.py": "def (:\n",
}


@pytest.fixture
def library(tmp_path, monkeypatch):
    root = tmp_path / "lib"
    for name, text in LIBRARY.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(textwrap.dedent(text))
    monkeypatch.setattr(stdlib_chat, "library", lambda: root)
    return root


def everything(root):
    return [c for split in ("train", "val") for c in stdlib_chat.conversations(root, split)]


def test_public_documented_objects_are_asked_about_in_two_phrasings(library):
    convs = everything(library)
    asked = {}
    for where, messages in convs:
        asked.setdefault(where.removeprefix("stdlib-chat: "), []).append(messages)
    assert sorted(asked) == ["jsonish.Encoder", "jsonish.Encoder.encode", "jsonish.dumps",
                             "jsonish.loads", "long.wordy"]
    for name, found in asked.items():
        assert len(found) == 2 and found[0][0] != found[1][0]  # two phrasings
        kind = stdlib_chat.CLASS if name == "jsonish.Encoder" else stdlib_chat.FUNCTION
        assert {m[0]["content"] for m in found} <= {p.format(name) for p in kind}
    assert asked["jsonish.dumps"][0][1] == {"role": "assistant",
                                             "content": "Serialize obj to a JSON formatted str."}
    assert asked["long.wordy"][0][1]["content"] == "A first sentence that ends here."
    follow = asked["jsonish.dumps"][0]  # the module's first object goes on to its next
    assert follow[2:] == [{"role": "user", "content": "And jsonish.loads?"},
                          {"role": "assistant", "content": "Deserialize s."}]


def test_the_split_is_by_module(library, monkeypatch):
    monkeypatch.setattr(stdlib_chat, "split_of", lambda m: "val" if m == "long" else "train")
    assert {w for w, _ in stdlib_chat.conversations(library, "val")} == {"stdlib-chat: long.wordy"}
    out = library.parent / "chat"
    prepare.run(PrepareConfig(sources=["stdlib-chat"], chat=True, tokenizer="byte",
                              out=str(out), workers=1))
    ds = TokenDataset(out)
    assert ds.meta["source"]["stats"]["val_documents"] == 2  # long.wordy, twice
    tok = ChatTokens(ByteTokenizer())
    val = tok.decode(np.concatenate(ds.tokens("val")).tolist())
    assert val.count("long.wordy") == 2 and "jsonish" not in val
    assert ds.masked and ds.meta["source"]["stats"]["train_documents"] == 8


def test_the_built_in_conversations_go_with_chat_and_their_own_split(library, tmp_path):
    with pytest.raises(UserError, match=r"^the built-in conversations \(stdlib-chat\) are "
                       "conversations: prepare them with --chat$"):
        prepare.run(PrepareConfig(sources=["stdlib-chat"], out=str(tmp_path / "a")))
    with pytest.raises(UserError, match=r"^the sources are the built-in conversations "
                       r"\(stdlib-chat\): --val-fraction 0.2 does not apply to them; drop it$"):
        prepare.run(PrepareConfig(sources=["stdlib-chat"], chat=True, val_fraction=0.2,
                                  out=str(tmp_path / "b")))


def test_this_pythons_library_is_split_by_module():
    """The real standard library: its public modules, about one in 20 of them val's."""
    modules = [m for m, _ in stdlib_chat.modules(stdlib_chat.library())]
    assert "json" in modules and "os" in modules and not any(".test" in m for m in modules)
    val = [m for m in modules if stdlib_chat.split_of(m) == "val"]
    assert 0.02 < len(val) / len(modules) < 0.09

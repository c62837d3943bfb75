"""The built-in conversations, on every machine that has Python: questions about the standard
library's public functions, classes and methods, answered by their docstrings' summaries.

    ddpgpt prepare stdlib-chat --chat --tokenizer-from runs/base --out data/chat

Each `.py` file of the running interpreter's standard library (its tests, IDLE, the demos and
private modules left out) is parsed with `ast`, never imported. Every public top-level function
and class, and every public method of such a class, whose docstring has a summary (its first
paragraph, or that paragraph's first sentence when the paragraph runs past SUMMARY_CHARS) is
asked about in two of four phrasings, each a conversation of its own:

    user: What does json.dumps do?       assistant: Serialize ``obj`` to a JSON formatted ``str``.

and every FOLLOW_UP-th one goes on with a second question on the next object of the module ("And
json.loads?"). The train and val splits are by module (one in VAL_MODULES, by a hash of its
name): the val split asks about modules the fine-tune never saw. The whole set is two units,
train's and val's, each read by one worker.
"""

from __future__ import annotations

import ast
import re
import sysconfig
import zlib
from collections.abc import Iterator
from pathlib import Path

from ddpgpt.data.formats.base import Format, Unit, UnitStats
from ddpgpt.errors import UserError

SKIP = {"test", "tests", "idlelib", "turtledemo", "lib2to3", "ensurepip", "pydoc_data",
        "site-packages", "dist-packages", "__pycache__"}
FUNCTION = ("What does {} do?", "What is {} for?", "Explain {}.", "Tell me what {} does.")
CLASS = ("What is {}?", "What is the class {} for?", "Explain the class {}.", "Describe {}.")
SUMMARY_CHARS = 300  # a longer first paragraph is cut to its first sentence
VAL_MODULES = 20  # one module in 20 is val's
FOLLOW_UP = 5
_SENTENCE = re.compile(r"^(.+?[.!?])(\s|$)")


def summary(doc: str | None) -> str | None:
    """A docstring's first paragraph on one line (its first sentence when long); None when
    there is none worth an answer."""
    if not doc:
        return None
    text = " ".join(doc.strip().split("\n\n", 1)[0].split())
    if len(text) > SUMMARY_CHARS:
        found = _SENTENCE.match(text)
        text = found.group(1) if found else ""
    return text if 8 <= len(text) <= SUMMARY_CHARS else None


def modules(root: Path) -> Iterator[tuple[str, Path]]:
    """(dotted name, file) of the standard library's public modules, in path order."""
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if not parts or SKIP & set(parts) or any(p.startswith("_") for p in parts) or \
                any(not p.isidentifier() for p in parts):
            continue
        yield ".".join(parts), path


def objects(tree: ast.Module, module: str) -> Iterator[tuple[str, str, str]]:
    """(qualified name, function or class, its summary) of a module's public objects."""
    for node in tree.body:
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) or \
                node.name.startswith("_"):
            continue
        kind = "class" if isinstance(node, ast.ClassDef) else "function"
        text = summary(ast.get_docstring(node))
        if text:
            yield f"{module}.{node.name}", kind, text
        if kind == "class":
            for item in node.body:
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef) and \
                        not item.name.startswith("_") and (text := summary(ast.get_docstring(
                            item))):
                    yield f"{module}.{node.name}.{item.name}", "function", text


def library() -> Path:
    """The running interpreter's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def split_of(module: str) -> str:
    return "val" if zlib.crc32(module.encode()) % VAL_MODULES == 0 else "train"


def conversations(root: Path, split: str) -> Iterator[tuple[str, list[dict]]]:
    """(where, messages) of the split's conversations, in module order."""
    for module, path in modules(root):
        if split_of(module) != split:
            continue
        try:
            tree = ast.parse(path.read_bytes())
        except (SyntaxError, ValueError, OSError):  # a file of this Python's that is not its
            continue
        found = list(objects(tree, module))
        for i, (name, kind, text) in enumerate(found):
            phrasings = CLASS if kind == "class" else FUNCTION
            first = zlib.crc32(name.encode()) % len(phrasings)
            for k in (first, (first + 1 + zlib.crc32(text.encode()) % 3) % len(phrasings)):
                messages = [{"role": "user", "content": phrasings[k].format(name)},
                            {"role": "assistant", "content": text}]
                if i % FOLLOW_UP == 0 and k == first and i + 1 < len(found):
                    messages += [{"role": "user", "content": f"And {found[i + 1][0]}?"},
                                 {"role": "assistant", "content": found[i + 1][2]}]
                yield f"stdlib-chat: {name}", messages


class StdlibChat(Format):
    name = "stdlib-chat"
    prefix = "stdlib-chat"
    conversations = True
    only_conversations = True  # its records are conversations: prepare --chat
    refuses = ("text_field", "skip_bad_rows", "val_fraction")  # the split is by module

    @property
    def described(self) -> str:
        return "the built-in conversations (stdlib-chat)"

    def stream(self, spec: str) -> tuple:
        if spec != self.prefix:
            raise UserError(f"source {spec!r}: the built-in conversations are named "
                            f"{self.prefix}, with nothing after it")
        return (str(library()),)

    def plan_stream(self, paths: tuple) -> list[Unit]:
        return [Unit(self.name, paths, split=split) for split in ("train", "val")]

    def where(self, unit: Unit) -> str:
        return f"{self.prefix} ({unit.split})"

    def records(self, unit: Unit, field: str, skip_bad: bool,
                stats: UnitStats) -> Iterator[tuple[str, object]]:
        return conversations(Path(unit.paths[0]), unit.split)


ROW = StdlibChat()

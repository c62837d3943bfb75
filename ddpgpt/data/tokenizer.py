"""Tokenizers: `bpe` (byte-level BPE trained on the corpus), `byte` (raw UTF-8 bytes), `gpt2`.

All three share one small interface: `vocab_size`, `eot_id`, `encode_batch(texts)` returning one
uint32 array per text (no end-of-text tokens added; `prepare` places them), `decode(ids)`, and
`special`: the chat template's tokens it holds, by id (data/chat.py). A bpe holds them in its
tokenizer.json (reserved when prepare trains it for conversations, added by `with_chat`); byte
and gpt2, whose ids are fixed, take them after their own ids, as the kinds `byte+chat` and
`gpt2+chat` (`ChatTokens`).

The bpe tokenizer splits text into pre-tokens (runs of letters, of digits, of other symbols, of
whitespace; BPE never merges across them) with GPT-2's pattern, each run capped at
`MAX_PRETOKEN_CHARS`: BPE work on one pre-token grows with the square of its length, and a line of
megabytes without a space would otherwise be one pre-token that takes hours to train on. Below the
cap the pre-tokens are exactly GPT-2's (the Python standard library's longest is 201 characters),
so ordinary text tokenizes as with an uncapped tokenizer.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from ddpgpt.data import chat, storage
from ddpgpt.errors import DataError, UserError
from ddpgpt.files import atomic_write, require

EOT_TEXT = "<|endoftext|>"
MIN_BPE_VOCAB = 257  # 256 byte symbols + the end-of-text token
MAX_PRETOKEN_CHARS = 1024  # far above ordinary pre-tokens; smaller is not much faster
# GPT-2's pattern, which ByteLevel(use_regex=True) splits with, each run capped. (Capping after
# ByteLevel instead would take a second regex pass over every pre-token: ~1.7x the CPU time.)
PRETOKEN_PATTERN = (r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
                    .replace("+", f"{{1,{MAX_PRETOKEN_CHARS}}}"))


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, end-of-text 256."""

    kind = "byte"
    vocab_size = 257
    eot_id = 256

    @property
    def special(self) -> dict[str, int]:
        return {}

    def encode_batch(self, texts: list[str | bytes]) -> list[np.ndarray]:
        """bytes are taken as they are (a file's exact bytes), str as its UTF-8."""
        return [np.frombuffer(t if isinstance(t, bytes) else t.encode("utf-8", "surrogatepass"),
                              dtype=np.uint8).astype(np.uint32) for t in texts]

    def decode_bytes(self, ids: np.ndarray) -> bytes:
        ids = np.asarray(ids)
        return ids[ids != self.eot_id].astype(np.uint8).tobytes()

    def decode(self, ids: Iterable[int]) -> str:
        out, pieces = bytearray(), []
        for i in ids:
            if i == self.eot_id:
                pieces += [out.decode("utf-8", "replace"), EOT_TEXT]
                out = bytearray()
            else:
                out.append(i)
        return "".join(pieces) + out.decode("utf-8", "replace")

    def save(self, out_dir: Path) -> None:
        pass


class BPETokenizer:
    """Byte-level BPE from HF `tokenizers`; stored as `tokenizer.json` beside the shards."""

    kind = "bpe"

    def __init__(self, tok):
        self._tok = tok
        self.vocab_size = tok.get_vocab_size()
        self.eot_id = tok.token_to_id(EOT_TEXT)
        self.special = {t: i for t in chat.TOKENS if (i := tok.token_to_id(t)) is not None}

    def with_tokens(self, tokens: Iterable[str]) -> BPETokenizer:
        """This tokenizer with `tokens` added as special tokens (new ids after its own; those
        it has already keep theirs)."""
        from tokenizers import AddedToken, Tokenizer

        tok = Tokenizer.from_str(self._tok.to_str())
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in tokens])
        return BPETokenizer(tok)

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int, show_progress: bool = True,
              reserved: tuple[str, ...] = ()) -> BPETokenizer:
        """`reserved`: special tokens beside end-of-text (the chat template's), ids 1.. ."""
        from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

        if vocab_size < MIN_BPE_VOCAB + len(reserved):
            also = f" + {len(reserved)} chat tokens" if reserved else ""
            raise UserError(
                f"--vocab-size {vocab_size} is too small: a byte-level BPE needs at least "
                f"{MIN_BPE_VOCAB + len(reserved)} (256 bytes + end-of-text{also}); use e.g. "
                "--vocab-size 4096"
            )
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.Sequence([  # saved in tokenizer.json, used by sample
            pre_tokenizers.Split(Regex(PRETOKEN_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=[EOT_TEXT, *reserved],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=show_progress,
        )
        tok.train_from_iterator(texts, trainer)
        return cls(tok)

    @classmethod
    def load(cls, data_dir: str | Path) -> BPETokenizer:
        """The tokenizer.json of a dataset or run directory (a local path or a URL)."""
        from tokenizers import Tokenizer

        files = storage.open_dir(data_dir)
        try:
            return cls(Tokenizer.from_str(files.read("tokenizer.json").decode()))
        except Exception as e:  # tokenizers raises plain Exception for missing or bad files
            reason = e.strerror if isinstance(e, OSError) and e.strerror else e
            raise DataError(f"{files.where('tokenizer.json')}: cannot load the bpe tokenizer "
                            f"({reason}); re-run ddpgpt prepare") from None

    @property
    def backend(self):
        """HF `tokenizers`' own Tokenizer (export hands it to transformers)."""
        return self._tok

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        # encode_batch_fast skips offset tracking; both release the GIL and use every core.
        encode = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
        return [np.asarray(e.ids, dtype=np.uint32) for e in encode(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def decode_bytes(self, ids: np.ndarray) -> bytes:
        """The bytes behind the ids exactly (decode() would replace a character cut in two)."""
        table = {c: b for b, c in _byte_level_chars().items()}
        vocab = self._tok.id_to_token
        return bytes(table[c] for i in np.asarray(ids).tolist() if i != self.eot_id
                     for c in vocab(i))

    def save(self, out_dir: Path) -> None:
        """tokenizer.json in `out_dir`, written whole or not at all (files.atomic_write)."""
        with atomic_write(Path(out_dir) / "tokenizer.json") as f:
            f.write(self._tok.to_str(pretty=True).encode())


class GPT2Tokenizer:
    """tiktoken's GPT-2 encoding (50257 ids, end-of-text 50256); needs the `data` extra.
    `threads`: tiktoken's threads per encode_batch (a prepare worker uses one)."""

    kind = "gpt2"

    def __init__(self, threads: int = 2):
        self.threads = threads
        tiktoken = require("tiktoken", "data", "--tokenizer gpt2")
        try:
            self._enc = tiktoken.get_encoding("gpt2")
        except Exception as e:
            raise UserError(
                f"cannot load tiktoken's gpt2 encoding ({type(e).__name__}); it downloads its "
                "files once: connect to the network, or point TIKTOKEN_CACHE_DIR at a cached copy"
            ) from None
        self.vocab_size = self._enc.n_vocab
        self.eot_id = self._enc.eot_token

    @property
    def special(self) -> dict[str, int]:
        return {}

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        if self.threads == 1:
            batch = [self._enc.encode_ordinary(t) for t in texts]
        else:
            batch = self._enc.encode_ordinary_batch(texts, num_threads=self.threads)
        return [np.asarray(ids, dtype=np.uint32) for ids in batch]

    def decode_bytes(self, ids: np.ndarray) -> bytes:
        return self._enc.decode_bytes([i for i in np.asarray(ids).tolist() if i != self.eot_id])

    def decode(self, ids: Iterable[int]) -> str:
        return self._enc.decode(list(ids), errors="replace")

    def save(self, out_dir: Path) -> None:
        pass


def _byte_level_chars() -> dict[int, str]:
    """GPT-2's byte-level alphabet: byte -> the printable character that stands for it."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    extra = iter(range(256, 512))
    return {b: chr(b) if b in keep else chr(next(extra)) for b in range(256)}


class ChatTokens:
    """A byte or gpt2 tokenizer with the chat template's tokens after its own ids (kind
    `byte+chat`, `gpt2+chat`): text encodes as the base's does, never to them."""

    def __init__(self, base):
        self.base, self.kind, self.eot_id = base, base.kind + CHAT_KIND, base.eot_id
        self.special = {t: base.vocab_size + i for i, t in enumerate(chat.TOKENS)}
        self.vocab_size = base.vocab_size + len(chat.TOKENS)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return self.base.encode_batch(texts)

    def decode(self, ids: Iterable[int]) -> str:
        names = {i: t for t, i in self.special.items()}
        out, run = [], []
        for i in ids:
            if i in names:
                out += [self.base.decode(run), names[i]]
                run = []
            else:
                run.append(i)
        return "".join(out) + self.base.decode(run)

    def decode_bytes(self, ids: np.ndarray) -> bytes:
        ids = np.asarray(ids)
        return self.base.decode_bytes(ids[ids < self.base.vocab_size])

    def save(self, out_dir: Path) -> None:
        self.base.save(out_dir)


CHAT_KIND = "+chat"


def with_chat(tok):
    """`tok` with the chat template's tokens (itself if it has them all)."""
    if not chat.missing(tok.special):
        return tok
    if isinstance(tok, BPETokenizer):
        return tok.with_tokens(chat.TOKENS)
    return ChatTokens(tok)


def grows_by_chat(base: tuple[str, str | Path], grown: tuple[str, str | Path]) -> bool:
    """Whether the tokenizer `grown` (kind, directory) is `base`'s with the chat template's
    tokens after its own ids, and nothing else changed: what `prepare --chat --tokenizer-from`
    makes of a base run's, a dataset's or an export's tokenizer (so a model of the base's ids
    reads every id of it but the new ones, whose rows it grows: run/init_weights.py)."""
    (base_kind_, base_dir), (kind, directory) = base, grown
    if base_kind_ in ("byte", "gpt2"):
        return kind == base_kind_ + CHAT_KIND
    if base_kind_ != "bpe" or kind != "bpe":
        return False
    try:
        old, new = (_normalized(Path(d) / "tokenizer.json") for d in (base_dir, directory))
    except Exception:  # tokenizers raises plain Exception on a bad file, json ValueError
        return False
    size = BPETokenizer(_tokenizers().Tokenizer.from_str(json.dumps(old))).vocab_size
    added = [t for t in new.get("added_tokens", []) if t["content"] in chat.TOKENS]
    new["added_tokens"] = [t for t in new.get("added_tokens", []) if t not in added]
    return (len(added) == len(chat.TOKENS) and all(t["id"] >= size for t in added)
            and new == old)


def _tokenizers():
    import tokenizers
    return tokenizers


def _normalized(path: Path) -> dict:
    """A tokenizer.json as `tokenizers` writes it back (transformers' copy and ours differ in
    layout, not in content)."""
    return json.loads(_tokenizers().Tokenizer.from_file(str(path)).to_str())


def base_kind(kind: str) -> str:
    """A tokenizer kind without the chat tokens' suffix: byte+chat -> byte."""
    return kind.removesuffix(CHAT_KIND)


class TokenizerSpec:
    """What a prepare worker needs to make its own tokenizer (picklable): the kind, and for bpe
    the tokenizer.json to load. Workers run one thread each."""

    def __init__(self, kind: str, directory: str | None = None):
        self.kind, self.directory = kind, directory

    def __call__(self):
        if base_kind(self.kind) == "gpt2":
            tok = GPT2Tokenizer(threads=1)
            return ChatTokens(tok) if self.kind != "gpt2" else tok
        return load_tokenizer(self.directory, self.kind)


def fingerprint(kind: str, directory: str | Path) -> str:
    """What names a tokenizer's mapping from text to ids, not merely its size: `byte` and `gpt2`
    are fixed, a bpe is its `tokenizer.json` (sha256 of the file in `directory`, a dataset or a
    run dir). Two bpe tokenizers of the same vocabulary size trained on different corpora differ
    here, and a model trained on one reads the other's ids as noise."""
    if kind != "bpe":
        return kind
    files = storage.open_dir(directory)
    try:
        return f"bpe:{files.sha256('tokenizer.json')}"
    except (OSError, KeyError) as e:
        reason = e.strerror if isinstance(e, OSError) else "missing"
        raise DataError(f"{files.where('tokenizer.json')}: cannot read the bpe tokenizer "
                        f"({reason}); re-run ddpgpt prepare") from None


GPT2_IDS = {"<|endoftext|>": 50256, "\u0120the": 262}  # " the": GPT-2's byte-level vocabulary
GPT2_VOCAB = 50257


def folder_tokenizer(folder: Path, where: str) -> str | None:
    """The fingerprint (as `fingerprint`) of the tokenizer saved in a transformers directory:
    its config.json's `ddpgpt` entry (`ddpgpt export` writes it), gpt2 for GPT-2's vocabulary
    (tokenizer.json or vocab.json), else its tokenizer.json's (bpe); None when none of them
    says. `where`: who asks, to name in the line of a file that cannot be read."""
    folder = Path(folder)
    try:
        config = json.loads((folder / "config.json").read_text()) \
            if (folder / "config.json").is_file() else {}
        marker = (config.get("ddpgpt") or {}).get("tokenizer")
        if marker:
            return marker
        if (folder / "tokenizer.json").is_file():
            tok = json.loads((folder / "tokenizer.json").read_text())
            vocab = dict(tok["model"]["vocab"])
            vocab.update({t["content"]: t["id"] for t in tok.get("added_tokens", [])})
        elif (folder / "vocab.json").is_file():
            vocab = json.loads((folder / "vocab.json").read_text())
        else:
            return None
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise UserError(f"{where}: cannot read its tokenizer ({e})") from None
    if len(vocab) == GPT2_VOCAB and all(vocab.get(t) == i for t, i in GPT2_IDS.items()):
        return "gpt2"
    return fingerprint("bpe", folder) if (folder / "tokenizer.json").is_file() else None


def load_tokenizer(data_dir: str | Path, kind: str):
    """The tokenizer a prepared dataset was made with (`kind` from its meta.json)."""
    if kind in ("byte" + CHAT_KIND, "gpt2" + CHAT_KIND):
        return ChatTokens(load_tokenizer(data_dir, base_kind(kind)))
    if kind == "bpe":
        return BPETokenizer.load(data_dir)
    if kind == "byte":
        return ByteTokenizer()
    if kind == "gpt2":
        return GPT2Tokenizer()
    raise DataError(f"{data_dir}/meta.json: unknown tokenizer {kind!r}; re-run ddpgpt prepare")

"""What `--init-from` names, whatever it is, for a run that starts from its weights:

    ddpgpt train --data data/chat --init-from runs/base                  # a run's newest checkpoint
    ddpgpt train --data data/chat --init-from runs/base/checkpoints/step_0000400
    ddpgpt train --data data/chat --init-from exported/base               # transformers' weights

- a ddpgpt run directory (its newest complete checkpoint) or one of its checkpoints: the weights
  in the single-device model's own layout, the model's shape from the config it was trained
  with, its tokenizer from its run dir (data_meta.json, tokenizer.json);
- anything else: weights in transformers' layouts, GPT-2's or the Llama family's, an export
  among them (hf/init_from.py).

The vocabulary grows by the chat template's tokens. Conversations prepared with the base's
tokenizer (`prepare --chat --tokenizer-from BASE`) have the base's ids and six more after them
(data/tokenizer.py: grows_by_chat). The model's vocabulary becomes the data's (its rows padded
as any dataset's are), and the embedding's and the head's rows for the new ids start as the mean
of the base's rows (a token the model has not seen starts as the average one, not as noise or
zeros the softmax would read as a likely token), said in one line at the start. A GPT-2 model's
padding rows already hold them (50,263 ids in 50,304 rows): its mask of padded logits
(model.vocab_limit) moves past them.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from ddpgpt.checkpoint import read, store
from ddpgpt.config.checks import ConfigError
from ddpgpt.config.io import from_dict
from ddpgpt.config.schema import TrainConfig, padded_vocab
from ddpgpt.data import chat
from ddpgpt.data.tokenizer import grows_by_chat
from ddpgpt.errors import UserError
from ddpgpt.hf import init_from as hf

# The model fields a run's weights fix (the others are how it runs: attention, kernels, ...).
NOT_WEIGHTS = ("doc_mask", "bos_id", "attention", "kernels", "dropout", "init_from")
GROWN = ("wte.weight", "lm_head.weight")  # the rows of ids: the embedding, an untied head


class Shape:
    """--model.init-from's shape for config.io.build (apply_shape; the weights read only when
    asked for); `note(cfg)`, once the config is built, the line that says what they changed."""

    def __init__(self):
        self.before: TrainConfig | None = None

    def __call__(self, cfg: TrainConfig, explicit: dict) -> TrainConfig:
        self.before = cfg
        return apply_shape(cfg, explicit)

    def note(self, cfg: TrainConfig) -> list[str]:
        return [] if self.before is None else [hf.shape_note(self.before, cfg)]


def checkpoint_of(spec: str) -> tuple[Path, dict] | None:
    """The checkpoint `spec` names when it is a ddpgpt run directory (its newest complete one)
    or one of a run's checkpoints, with its meta.json; None for anything else."""
    path = Path(spec)
    if (path / "meta.json").is_file() and path.parent.name == "checkpoints":
        return path, store.read_meta(path)
    if (path / "checkpoints").is_dir() and (path / "config.json").is_file():
        found = store.find_latest(path / "checkpoints")
        if found is None:
            raise UserError(f"--init-from {spec}: run {spec} has no complete checkpoint; train "
                            "it first, or give a checkpoint or an export")
        return found
    return None


def apply_shape(cfg: TrainConfig, explicit: dict[str, str]) -> TrainConfig:
    """cfg with the model shape of the --init-from weights (hf.apply_shape's, for a run's too:
    every field its config has that the weights fix); a field the user set otherwise is one
    line."""
    spec = cfg.model.init_from
    found = checkpoint_of(spec)
    if found is None:
        return hf.apply_shape(cfg, explicit)
    theirs = from_dict(found[1]["config"], str(found[0] / "meta.json")).model.resolved()
    fields = [f.name for f in dataclasses.fields(theirs) if f.name not in NOT_WEIGHTS]
    want = {n: getattr(theirs, n) for n in fields}
    conflicts = [f"model.{n} = {getattr(cfg.model, n)} ({explicit[n]}) but the run has {v}"
                 for n, v in want.items() if n in explicit and getattr(cfg.model, n) != v
                 and not (n == "vocab_size" and getattr(cfg.model, n) > v)]
    if conflicts:
        raise ConfigError(f"--init-from {spec}: {'; '.join(conflicts)}; leave the shape out, it "
                          "comes from the run")
    want.update({n: getattr(cfg.model, n) for n in ("vocab_size",) if n in explicit})
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **want))


def check_tokenizer(cfg: TrainConfig, dataset) -> None:
    """The dataset's tokenizer is the one the weights were trained with, or it with the chat
    template's tokens after its ids; else one line. A hub name is downloaded here, once."""
    spec = cfg.model.init_from
    found = checkpoint_of(spec)
    if found is None:
        hf.check_tokenizer(cfg, dataset)
        hf.locate(spec)
        return
    path, meta = found
    run, theirs, ours = path.parent.parent, read.trained_tokenizer(path, meta), \
        dataset.tokenizer_fingerprint
    if ours == theirs or grows_by_chat((_kind(run), run), (dataset.tokenizer, dataset.path)):
        return
    raise UserError(f"--init-from {spec}: the run's tokenizer ({_short(theirs)}) is not the one "
                    f"of data.dir = {cfg.data.dir} ({_short(ours)}), nor it with the chat "
                    "template's tokens added: its ids would mean other text; prepare the data "
                    f"with --tokenizer-from {run}")


def _kind(run: Path) -> str:
    try:
        return json.loads((run / "data_meta.json").read_text())["tokenizer"]
    except (OSError, ValueError, KeyError, TypeError):
        return ""


def _short(fp: str | None) -> str:
    kind, _, digest = (fp or "unknown").partition(":")
    return f"{kind} {digest[:12]}" if digest else kind


def base_vocab(spec: str) -> int:
    """The ids the --init-from weights were trained on (their tokenizer's, unpadded)."""
    found = checkpoint_of(spec)
    if found is None:
        return int(hf.weights_shape(spec)["vocab"])
    return int(json.loads((found[0].parent.parent / "data_meta.json").read_text())["vocab_size"])


def grow_vocab(cfg: TrainConfig, dataset) -> TrainConfig:
    """cfg with the model's vocabulary grown to the data's when the data has more ids than the
    weights (the chat template's: check_tokenizer let them in): its rows padded as a dataset's
    are, and a GPT-2 model's mask of padded logits moved past them."""
    model = cfg.model
    if dataset.vocab_size <= (model.vocab_limit or model.vocab_size):
        return cfg
    rows = max(model.vocab_size, padded_vocab(dataset.vocab_size))
    limit = dataset.vocab_size if model.vocab_limit else 0
    return dataclasses.replace(cfg, model=dataclasses.replace(model, vocab_size=rows,
                                                              vocab_limit=limit))


def read_state(spec: str, model, vocab: int) -> dict[str, torch.Tensor]:
    """Our state dict for a model of shape `model` (a ModelConfig) from the weights `spec`, the
    rows of the ids past theirs (up to the data's `vocab`) the mean of their trained rows."""
    found = checkpoint_of(spec)
    state = hf.read_state(spec, model) if found is None else read.weights(*found)
    base = base_vocab(spec)
    for name in GROWN:
        t = state.get(name)
        if t is None:
            continue
        if t.size(0) < model.vocab_size:  # a run's rows, padded as hf's readers pad theirs
            t = torch.cat([t, t.new_zeros(model.vocab_size - t.size(0), t.size(1))])
        if vocab > base:
            t = t.clone()
            t[base:vocab] = t[:base].mean(0)
        state[name] = t
    return state


def grown(spec: str, model, vocab: int) -> str | None:
    """The line that says the vocabulary grew (None when it did not)."""
    base = base_vocab(spec)
    if vocab <= base:
        return None
    added = vocab - base
    what = "the chat template's tokens" if added == len(chat.TOKENS) else "new tokens"
    return (f"ddpgpt: --init-from {spec}: the vocabulary grows from {base:,} to {vocab:,} ids "
            f"({what}, ids {base}-{vocab - 1}; the model's rows: {model.vocab_size:,}), their "
            "embedding and head rows starting as the mean of the trained ones")


def loaded(spec: str, state: dict[str, torch.Tensor]) -> str:
    return hf.loaded(spec, state)

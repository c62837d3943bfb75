"""A transformers model as a model to evaluate, without a run: `ddpgpt eval --init-from DIR`.

    ddpgpt eval --init-from hf/gpt2 --task core --task-data eval_bundle   # GPT-2's own weights
    ddpgpt eval --init-from exported/ --task hellaswag --json            # a `ddpgpt export`

The shape and the weights are read as `train --init-from` reads them (init_from.py: GPT-2's
layout, Llama's and Qwen3's), so the model is the one a training from them would start with. The
tokenizer is the one saved beside the weights: its tokenizer.json (read by HF `tokenizers`, as
transformers reads it), else GPT-2's (tiktoken) when the weights are GPT-2's 50,257 ids, else
one line. The id a text starts with (what CORE prepends) is config.json's bos_token_id: GPT-2's
and Qwen3's <|endoftext|>, Llama 3's <|begin_of_text|>, an export's end-of-text; without one,
the tokenizer's <|endoftext|>.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

from ddpgpt.config.model import ModelConfig
from ddpgpt.config.schema import TrainConfig
from ddpgpt.data.tokenizer import BPETokenizer, GPT2Tokenizer
from ddpgpt.errors import UserError, warn
from ddpgpt.hf import init_from
from ddpgpt.model.gpt import GPT


@dataclass
class Pretrained:
    """What --init-from names, read: the model's config, its weights (ours, on the CPU), its
    tokenizer (eot_id: the id every text starts with) and the transformers class it was."""
    spec: str
    model: ModelConfig
    weights: dict[str, torch.Tensor]
    tokenizer: object
    kind: str


def load(spec: str) -> Pretrained:
    """The model at `spec` (a transformers directory, a .safetensors file or a hub name)."""
    base = TrainConfig(model=dataclasses.replace(ModelConfig(), init_from=spec))
    model = init_from.apply_shape(base, {}).model.resolved()
    folder = init_from.locate(spec)
    folder = folder if folder.is_dir() else folder.parent
    config = init_from.read_config(folder) or {}
    tokenizer = _tokenizer(spec, folder)
    bos = config.get("bos_token_id")
    if isinstance(bos, int) and not isinstance(bos, bool):
        tokenizer.eot_id = bos
    if tokenizer.eot_id is None:
        raise UserError(f"--init-from {spec}: neither config.json's bos_token_id nor the "
                        "tokenizer's <|endoftext|> says which id starts a text; add "
                        "bos_token_id to its config.json")
    if tokenizer.vocab_size > model.vocab_size:
        raise UserError(f"--init-from {spec}: the tokenizer beside the weights has "
                        f"{tokenizer.vocab_size:,} ids, the weights {model.vocab_limit:,}; put "
                        "the tokenizer they were trained with there")
    kind = (config.get("architectures") or [None])[0] or (
        "GPT2LMHeadModel" if model.arch == "gpt2" else "weights")
    return Pretrained(spec, model, init_from.read_state(spec, model), tokenizer, kind)


def _tokenizer(spec: str, folder: Path):
    if (folder / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        try:
            return BPETokenizer(Tokenizer.from_file(str(folder / "tokenizer.json")))
        except Exception as e:  # tokenizers raises plain Exception for a bad file
            raise UserError(f"--init-from {spec}: cannot read {folder / 'tokenizer.json'} "
                            f"({e})") from None
    kind, note = init_from.weights_tokenizer(spec)
    if kind == "gpt2":
        if note:
            warn(f"--init-from {spec}: {note}")
        return GPT2Tokenizer()
    raise UserError(f"--init-from {spec}: no tokenizer.json beside the weights says what their "
                    "ids mean; save the tokenizer they were trained with there "
                    "(tokenizer.save_pretrained(DIR))")


def model_of(found: Pretrained, device: torch.device | str) -> GPT:
    """The model on `device`, in eval mode."""
    model = GPT(found.model).to(device)
    model.load_state_dict(found.weights)
    return model.eval()

"""GPT-2's weight layout (Hugging Face transformers' GPT2LMHeadModel) and ours, both ways.

    ours                           GPT-2 (transformers)               note
    wte.weight (V_pad, C)          transformer.wte.weight (V, C)      our rows past V are padding
    wpe.weight                     transformer.wpe.weight
    blocks.i.ln1 / ln2             transformer.h.i.ln_1 / ln_2
    blocks.i.attn.qkv (3C, C)      transformer.h.i.attn.c_attn (C, 3C)  Conv1D: transposed
    blocks.i.attn.proj             transformer.h.i.attn.c_proj          Conv1D
    blocks.i.mlp.fc / proj         transformer.h.i.mlp.c_fc / c_proj    Conv1D
    ln_f                           transformer.ln_f
    (tied to wte)                  lm_head.weight                     tied: not stored

The mathematics is the same: pre-LayerNorm blocks (eps 1e-5), tanh-approximated GELU (GPT-2's
gelu_new), scaled dot-product attention, a head tied to the token embedding. A model without
biases is GPT-2 with zero biases. Pure functions of tensors: nothing here reads files.
"""

from __future__ import annotations

import re

import torch

from ddpgpt.config.model import ModelConfig
from ddpgpt.errors import UserError

# The hub's GPT-2 checkpoints: repository, layers, heads, width (all 1024 positions, 50,257 ids).
HUB = {"gpt2": ("openai-community/gpt2", 12, 12, 768),
       "gpt2-medium": ("openai-community/gpt2-medium", 24, 16, 1024),
       "gpt2-large": ("openai-community/gpt2-large", 36, 20, 1280),
       "gpt2-xl": ("openai-community/gpt2-xl", 48, 25, 1600)}
GPT2_POSITIONS = 1024  # and 50,257 ids: data/tokenizer.py GPT2_VOCAB
CONV1D = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")  # stored (in, out)
# ours <- theirs, per block
BLOCK_NAMES = {"ln1": "ln_1", "attn.qkv": "attn.c_attn", "attn.proj": "attn.c_proj",
               "ln2": "ln_2", "mlp.fc": "mlp.c_fc", "mlp.proj": "mlp.c_proj"}
# transformers' activation_function -> model.gelu (gelu_new and gelu_pytorch_tanh are the same
# function, the tanh approximation)
GELUS = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu": "exact"}
ACTIVATION = {"tanh": "gelu_new", "exact": "gelu"}  # model.gelu -> activation_function


def _theirs(name: str) -> str:
    """Our parameter name -> GPT-2's, without the `transformer.` prefix."""
    m = re.match(r"blocks\.(\d+)\.(.+)\.(weight|bias)$", name)
    if m:
        return f"h.{m.group(1)}.{BLOCK_NAMES[m.group(2)]}.{m.group(3)}"
    return name  # wte, wpe, ln_f


def strip_prefix(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """GPT-2 tensors without the `transformer.` prefix that GPT2LMHeadModel adds (the original
    GPT2Model checkpoints have none), and without what is not a weight: the attention masks
    older files stored (attn.bias, attn.masked_bias) and the tied head."""
    out = {}
    for name, t in tensors.items():
        name = name.removeprefix("transformer.")
        if name == "lm_head.weight" or re.fullmatch(r"h\.\d+\.attn\.(masked_)?bias", name):
            continue
        out[name] = t
    return out


def shape(shapes: dict[str, tuple[int, ...]], config: dict | None) -> dict:
    """The model shape of GPT-2 tensors (names as strip_prefix leaves them, to their shapes):
    n_layer, n_embd, block_size, vocab (unpadded), bias, and from `config` (config.json) when
    there is one (the tensors do not say them) n_head, the GELU and the norm's epsilon (else
    GPT-2's)."""
    if "wte.weight" not in shapes or "wpe.weight" not in shapes:
        raise ValueError("no wte.weight / wpe.weight")
    layers = {int(m.group(1)) for n in shapes if (m := re.match(r"h\.(\d+)\.", n))}
    vocab, n_embd = shapes["wte.weight"]
    out = {"n_layer": len(layers), "n_embd": n_embd, "block_size": shapes["wpe.weight"][0],
           "vocab": vocab, "bias": "h.0.attn.c_attn.bias" in shapes,
           "gelu": GELUS.get((config or {}).get("activation_function", "gelu_new"), "tanh"),
           "norm_eps": float((config or {}).get("layer_norm_epsilon", 1e-5))}
    if config and config.get("n_head"):
        out["n_head"] = int(config["n_head"])
    return out


def check_model(model: ModelConfig) -> None:
    """GPT2LMHeadModel computes `model` (learned positions) exactly, or one line naming the first
    setting it does not."""
    m = model.resolved()
    needs = [("norm", "layernorm"), ("qk_norm", False), ("mlp", "gelu"), ("tie_embeddings", True),
             ("logit_softcap", 0.0), ("n_kv_head", m.n_head), ("head_dim", m.n_embd // m.n_head),
             ("mlp_hidden", 4 * m.n_embd)]
    for name, value in needs:
        if getattr(m, name) != value:
            raise UserError(f"model.{name} = {_show(getattr(m, name))}: GPT2LMHeadModel, the "
                            f"transformers class for learned positions, computes only model."
                            f"{name} = {_show(value)}; train with that (or with model.arch "
                            "modern: Qwen3ForCausalLM) to export")


def _show(value) -> str:
    return str(value).lower() if isinstance(value, bool) else f"{value:g}" if isinstance(
        value, float) else str(value)


def check_config(config: dict, where: str) -> None:
    """A transformers config.json describes a model our GPT computes exactly, or one line."""
    problems = []
    if config.get("model_type", "gpt2") != "gpt2":
        problems.append(f"model_type {config['model_type']!r} (only gpt2)")
    if config.get("activation_function", "gelu_new") not in GELUS:
        problems.append(f"activation_function {config['activation_function']!r} (only "
                        "gelu_new or gelu)")
    if config.get("n_inner") not in (None, 4 * config.get("n_embd", 0)):
        problems.append(f"n_inner {config['n_inner']} (only 4 × n_embd)")
    for flag in ("scale_attn_by_inverse_layer_idx", "add_cross_attention"):
        if config.get(flag):
            problems.append(f"{flag} true")
    if not config.get("scale_attn_weights", True):
        problems.append("scale_attn_weights false")
    if problems:
        raise UserError(f"{where}: a GPT-2 variant that ddpgpt's model does not compute: "
                        f"{', '.join(problems)}; start from a plain GPT-2 checkpoint")


def from_gpt2(tensors: dict[str, torch.Tensor], vocab_size: int,
              bias: bool) -> dict[str, torch.Tensor]:
    """Our state dict from GPT-2 tensors (as strip_prefix leaves them): Conv1D matrices
    transposed, the embedding padded with zero rows up to `vocab_size` (the model masks them:
    model.vocab_limit). Without `bias`, every bias must be zero (that is what an export of a
    model without biases holds) and is dropped."""
    state = {}
    for ours in _names(tensors, bias):
        t = tensors[_theirs(ours)].to(torch.float32)
        if ours.endswith("weight") and _theirs(ours).rsplit(".", 1)[0].endswith(CONV1D):
            t = t.t()
        state[ours] = t.contiguous()
    nonzero = [n for n, t in tensors.items() if n.endswith(".bias") and t.any()]
    if not bias and nonzero:
        raise UserError(f"model.bias = false, but the weights have non-zero biases ({nonzero[0]}, "
                        "...); leave model.bias at true to keep them")
    wte = state["wte.weight"]
    if vocab_size > wte.size(0):
        pad = wte.new_zeros(vocab_size - wte.size(0), wte.size(1))
        state["wte.weight"] = torch.cat([wte, pad])
    return state


def to_gpt2(state: dict[str, torch.Tensor], vocab: int, bias: bool) -> dict[str, torch.Tensor]:
    """GPT2LMHeadModel's tensors (`transformer.` names, Conv1D (in, out) matrices, no lm_head:
    tied) from our state dict: the embedding cut to the tokenizer's `vocab` ids; without
    `bias`, zero biases where GPT-2 has them."""
    out = {}
    for ours, t in state.items():
        t = t.detach().to("cpu", torch.float32)
        theirs = _theirs(ours)
        if ours == "wte.weight":
            t = t[:vocab]
        elif ours.endswith("weight") and theirs.rsplit(".", 1)[0].endswith(CONV1D):
            t = t.t()
        out[f"transformer.{theirs}"] = t.contiguous()
        if not bias and ours.endswith("weight") and ours not in ("wte.weight", "wpe.weight"):
            out[f"transformer.{theirs[:-len('weight')]}bias"] = torch.zeros(t.shape[-1])
    return out


def _names(tensors: dict[str, torch.Tensor], bias: bool) -> list[str]:
    """Our parameter names for the layers present in GPT-2 `tensors`."""
    n_layer = len({int(m.group(1)) for n in tensors if (m := re.match(r"h\.(\d+)\.", n))})
    kinds = ("weight", "bias") if bias else ("weight",)
    names = ["wte.weight", "wpe.weight"]
    for i in range(n_layer):
        names += [f"blocks.{i}.{part}.{k}" for part in BLOCK_NAMES for k in kinds]
    return names + [f"ln_f.{k}" for k in kinds]

"""The Llama family's weight layout (Hugging Face transformers' LlamaForCausalLM,
Qwen3ForCausalLM and ApertusForCausalLM) and ours, both ways, and which of our models they compute.

    ours (model.arch modern)         theirs                                        note
    wte.weight (V_pad, C)            model.embed_tokens.weight (V, C)             our rows past V
                                                                                  are padding
    blocks.i.ln1                     model.layers.i.input_layernorm               Apertus:
                                                                                  attention_layernorm
    blocks.i.attn.qkv ((H+2K)·D, C)  model.layers.i.self_attn.q_proj, k_proj,     stacked rows
                                     v_proj
    blocks.i.attn.q_norm / k_norm    model.layers.i.self_attn.q_norm / k_norm     not Llama
    blocks.i.attn.proj               model.layers.i.self_attn.o_proj
    blocks.i.ln2                     model.layers.i.post_attention_layernorm      Apertus:
                                                                                  feedforward_layernorm
    blocks.i.mlp.gate / fc / proj    model.layers.i.mlp.gate_proj / up_proj /     Apertus: no gate
                                     down_proj
    ln_f                             model.norm
    lm_head.weight                   lm_head.weight                                absent: tied

All three compute what our model does with rotary positions (rotate_half pairs), RMSNorm and any
number of key/value heads. Llama and Qwen3 have a SwiGLU MLP; Qwen3 adds QK-norm (per head,
before the turn) and has no biases, Llama has none or biases on every projection. Apertus is
Qwen3's attention with an ungated MLP whose activation its config names (hidden_act): our ReLU²
(relu2) and GELU (gelu, gelu_pytorch_tanh) MLPs. Pure functions of tensors and config dicts:
nothing here reads files or imports transformers.
"""

from __future__ import annotations

import re

import torch

from ddpgpt.config.model import ModelConfig
from ddpgpt.errors import UserError

CLASSES = {"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM",
           "apertus": "ApertusForCausalLM"}  # model_type -> class
CONFIGS = {"qwen3": "Qwen3Config", "llama": "LlamaConfig", "apertus": "ApertusConfig"}
BLOCK = {"ln1": "input_layernorm", "attn.q_norm": "self_attn.q_norm",
         "attn.k_norm": "self_attn.k_norm", "attn.proj": "self_attn.o_proj",
         "ln2": "post_attention_layernorm", "mlp.gate": "mlp.gate_proj", "mlp.fc": "mlp.up_proj",
         "mlp.proj": "mlp.down_proj"}  # ours -> theirs, per block (qkv: split in three)
APERTUS = {**{k: v for k, v in BLOCK.items() if k != "mlp.gate"},
           "ln1": "attention_layernorm", "ln2": "feedforward_layernorm"}
# Apertus's hidden_act -> our ungated MLP's pieces (model.mlp, and model.gelu for GELU)
ACTIVATIONS = {"relu2": {"mlp": "relu2"}, "gelu": {"mlp": "gelu", "gelu": "exact"},
               "gelu_pytorch_tanh": {"mlp": "gelu", "gelu": "tanh"}}
TOP = {"wte.weight": "model.embed_tokens.weight", "ln_f.weight": "model.norm.weight",
       "lm_head.weight": "lm_head.weight"}
PROJ = ("q_proj", "k_proj", "v_proj")


def family(model: ModelConfig) -> str:
    """The model_type (qwen3, llama, apertus) whose transformers class computes `model`'s logits,
    or one line naming the first setting that none computes."""
    m = model.resolved()
    needs = [("rope", True, "rotary positions"), ("norm", "rmsnorm", "RMSNorm"),
             ("logit_softcap", 0.0, "no logit soft-cap")]
    for name, value, what in needs:
        if getattr(m, name) != value:
            raise UserError(f"model.{name} = {_show(getattr(m, name))}: no transformers class "
                            f"computes it (Qwen3ForCausalLM, LlamaForCausalLM and "
                            f"ApertusForCausalLM take {what}, model.{name} = {_show(value)}); "
                            "train with that to export")
    if m.mlp != "swiglu":  # ungated: Apertus's, which has QK-norm and no MLP biases
        if not m.qk_norm:
            raise UserError(f"model.mlp = {m.mlp} without model.qk_norm: ApertusForCausalLM, the "
                            "transformers class for an ungated MLP with rotary positions, has "
                            "QK-norm; train with model.qk_norm true (or model.mlp swiglu: "
                            "LlamaForCausalLM) to export")
        if m.bias:
            raise UserError(f"model.bias = true with model.mlp = {m.mlp}: ApertusForCausalLM, the "
                            "transformers class for an ungated MLP with rotary positions, has no "
                            "MLP biases; train with model.bias false to export")
        return "apertus"
    if m.qk_norm and m.bias:
        raise UserError("model.bias = true with model.qk_norm: Qwen3ForCausalLM (QK-norm) has no "
                        "MLP biases; train with model.bias false to export")
    if not m.qk_norm and m.n_embd % m.n_head:
        raise UserError(f"model.n_head = {m.n_head} does not divide model.n_embd = {m.n_embd}: "
                        "LlamaForCausalLM requires it (Qwen3's class would not, but it takes "
                        "QK-norm); train with model.qk_norm or such a width to export")
    return "qwen3" if m.qk_norm else "llama"


def _show(value) -> str:
    return str(value).lower() if isinstance(value, bool) else f"{value:g}" if isinstance(
        value, float) else str(value)


def config(model: ModelConfig, vocab: int) -> dict:
    """The transformers config fields that say `model` (resolved), its vocabulary cut to the
    tokenizer's `vocab` ids."""
    m = model.resolved()
    kind = family(m)
    act = "silu" if kind != "apertus" else next(
        name for name, pieces in ACTIVATIONS.items()
        if all(getattr(m, k) == v for k, v in pieces.items()))
    fields = {"vocab_size": vocab, "hidden_size": m.n_embd, "intermediate_size": m.mlp_hidden,
              "num_hidden_layers": m.n_layer, "num_attention_heads": m.n_head,
              "num_key_value_heads": m.n_kv_head, "head_dim": m.head_dim, "hidden_act": act,
              "max_position_embeddings": m.block_size, "rms_norm_eps": m.norm_eps,
              "rope_parameters": {"rope_type": "default", "rope_theta": m.rope_theta},
              "tie_word_embeddings": m.tie_embeddings, "attention_bias": m.bias,
              "attention_dropout": m.dropout}
    if kind == "llama":
        fields["mlp_bias"] = m.bias
    elif kind == "qwen3":
        fields["use_sliding_window"] = False
    else:
        fields["pad_token_id"] = None  # Apertus's default (3) would name one of our ids
    return fields


def _blocks(m: ModelConfig) -> dict[str, str]:
    """Ours -> theirs, per block, for the family that computes resolved `m`."""
    return APERTUS if m.mlp != "swiglu" else BLOCK


def shape(config: dict, where: str) -> dict:
    """Our model fields (and `vocab`, unpadded) from a Llama, Qwen3 or Apertus config.json, or
    one line naming what our model does not compute."""
    kind = config.get("model_type")
    rope = config.get("rope_parameters") or {
        "rope_type": (config.get("rope_scaling") or {}).get("rope_type", "default"),
        "rope_theta": config.get("rope_theta", 10000.0)}
    problems = []
    act, known = config.get("hidden_act", "silu"), ACTIVATIONS if kind == "apertus" else ["silu"]
    if act not in known:
        problems.append(f"hidden_act {act!r} (only {', '.join(known)})")
    if rope.get("rope_type", "default") != "default" or config.get("rope_scaling"):
        problems.append(f"rope scaling {rope.get('rope_type')!r} (only plain rotary)")
    bias = bool(config.get("attention_bias", False))
    if kind == "llama":
        if config.get("pretraining_tp") not in (None, 1):
            problems.append(f"pretraining_tp {config['pretraining_tp']} (only 1)")
        if bool(config.get("mlp_bias", False)) != bias:
            problems.append("attention_bias and mlp_bias differ (ddpgpt's model.bias is one "
                            "switch)")
    elif bias:
        problems.append(f"attention_bias true ({kind.capitalize()}'s MLP has none: ddpgpt's "
                        "model.bias is one switch)")
    if config.get("use_sliding_window") or "sliding_attention" in config.get("layer_types", []):
        problems.append("sliding-window layers")
    if problems:
        raise UserError(f"{where}: a {kind} variant that ddpgpt's model does not compute: "
                        f"{', '.join(problems)}; start from a plain {CLASSES[kind]} checkpoint")
    n_head = int(config["num_attention_heads"])
    mlp = ACTIVATIONS[act] if kind == "apertus" else {"mlp": "swiglu"}
    return {"arch": "modern", "rope": True, "norm": "rmsnorm", "qk_norm": kind != "llama",
            **mlp, "bias": bias,
            "tie_embeddings": bool(config.get("tie_word_embeddings", False)),
            "n_layer": int(config["num_hidden_layers"]), "n_head": n_head,
            "n_kv_head": int(config.get("num_key_value_heads") or n_head),
            "n_embd": int(config["hidden_size"]),
            "head_dim": int(config.get("head_dim") or config["hidden_size"] // n_head),
            "mlp_hidden": int(config["intermediate_size"]),
            "block_size": int(config["max_position_embeddings"]),
            "rope_theta": float(rope.get("rope_theta", 10000.0)),
            "norm_eps": float(config.get("rms_norm_eps", 1e-6)), "vocab": int(config["vocab_size"])}


def to_llama(state: dict[str, torch.Tensor], model: ModelConfig,
             vocab: int) -> dict[str, torch.Tensor]:
    """Their tensors from our state dict: qkv split into q_proj, k_proj, v_proj, the embedding
    and the head cut to the tokenizer's `vocab` ids, no lm_head when tied."""
    m = model.resolved()
    sizes = (m.n_head * m.head_dim, m.n_kv_head * m.head_dim, m.n_kv_head * m.head_dim)
    block, out = _blocks(m), {}
    for ours, t in state.items():
        t = t.detach().to("cpu", torch.float32)
        if ours in TOP:
            out[TOP[ours]] = t[:vocab] if ours != "ln_f.weight" else t
            continue
        i, part, kind = re.match(r"blocks\.(\d+)\.(.+)\.(weight|bias)$", ours).groups()
        prefix = f"model.layers.{i}."
        if part == "attn.qkv":
            for proj, piece in zip(PROJ, t.split(sizes, dim=0)):
                out[f"{prefix}self_attn.{proj}.{kind}"] = piece
        else:
            out[f"{prefix}{block[part]}.{kind}"] = t
    return {name: t.contiguous() for name, t in out.items()}


def from_llama(tensors: dict[str, torch.Tensor], model: ModelConfig) -> dict[str, torch.Tensor]:
    """Our state dict from their tensors (model.-prefixed names): q, k, v stacked into qkv, the
    embedding (and an untied head) padded with zero rows up to model.vocab_size (the model
    masks them: model.vocab_limit). A missing tensor is a KeyError naming it."""
    m = model.resolved()
    state = {"wte.weight": tensors["model.embed_tokens.weight"],
             "ln_f.weight": tensors["model.norm.weight"]}
    if not m.tie_embeddings:
        state["lm_head.weight"] = tensors["lm_head.weight"]
    kinds = ("weight", "bias") if m.bias else ("weight",)
    for i in range(m.n_layer):
        prefix = f"model.layers.{i}."
        for kind in kinds:
            state[f"blocks.{i}.attn.qkv.{kind}"] = torch.cat(
                [tensors[f"{prefix}self_attn.{p}.{kind}"] for p in PROJ])
        for part, name in _blocks(m).items():
            if part in ("attn.q_norm", "attn.k_norm") and not m.qk_norm:
                continue
            norm = part.startswith(("ln", "attn.q_norm", "attn.k_norm"))
            for kind in ("weight",) if norm else kinds:
                state[f"blocks.{i}.{part}.{kind}"] = tensors[f"{prefix}{name}.{kind}"]
    for name in ("wte.weight", "lm_head.weight"):
        t = state.get(name)
        if t is not None and m.vocab_size > t.size(0):
            state[name] = torch.cat([t, t.new_zeros(m.vocab_size - t.size(0), t.size(1))])
    return {name: t.to(torch.float32).contiguous() for name, t in state.items()}

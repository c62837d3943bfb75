"""`ddpgpt export`: a run's checkpoint as a directory that Hugging Face transformers loads.

    ddpgpt export --run-dir runs/tiny --out exported/tiny          # the newest checkpoint
    ddpgpt export --run-dir runs/tiny --step 100 --out exported/tiny-100

    model = transformers.AutoModelForCausalLM.from_pretrained("exported/tiny")
    tokenizer = transformers.AutoTokenizer.from_pretrained("exported/tiny")

The directory holds config.json, model.safetensors and generation_config.json (end-of-text as
EOS) for the transformers class that computes the run's model exactly: GPT2LMHeadModel for
model.arch gpt2 (gpt2.py's layout), Qwen3ForCausalLM for modern, LlamaForCausalLM for modern
without QK-norm, ApertusForCausalLM for modern with a ReLU² or GELU MLP (llama.py's); a mix that
no class computes (a logit soft-cap, learned positions with RMSNorm, ...) is refused in one line
naming the setting. And the run's tokenizer:
- bpe: its tokenizer.json, as a PreTrainedTokenizerFast;
- byte: the same ids as a byte-level BPE without merges (bytes 0-255, then end-of-text), so
  transformers encodes and decodes exactly as ddpgpt's byte tokenizer does;
- gpt2: GPT-2's tokenizer, converted from tiktoken's encoding (cached by `prepare --tokenizer
  gpt2`), or else the Hugging Face hub's openai-community/gpt2 files (cached or downloaded).
A run fine-tuned on conversations (its tokenizer holds the chat template's tokens: byte+chat,
gpt2+chat, or a bpe with them) exports them as special tokens at the same ids, the template as
the tokenizer's `chat_template` (data/chat.py's JINJA: `apply_chat_template(messages,
add_generation_prompt=True)` gives the ids `ddpgpt chat` feeds the model) and
<|assistant_end|> beside end-of-text among generation_config's eos_token_id, so greedy
`generate` stops where `ddpgpt chat` does.
The vocabulary is cut to the tokenizer's own ids (our padding rows are not exported), and a GPT-2
model without biases gets zero biases. config.json also records the tokenizer's fingerprint under
`ddpgpt`, so `--init-from` the directory checks it against a dataset's. Needs the export extra.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from ddpgpt.checkpoint.read import run_checkpoint
from ddpgpt.config.commands import ExportConfig
from ddpgpt.config.model import ModelConfig
from ddpgpt.data import chat
from ddpgpt.data.prepare.output import check_out, publish
from ddpgpt.data.tokenizer import EOT_TEXT, BPETokenizer, base_kind, fingerprint
from ddpgpt.errors import UserError
from ddpgpt.files import as_created, require
from ddpgpt.hf import gpt2, llama
from ddpgpt.run.run_dir import RunDir


def run(cfg: ExportConfig) -> None:
    require("transformers", "export", "ddpgpt export")
    if cfg.out is None:
        raise UserError("ddpgpt export needs --out DIR")
    run_dir, out = RunDir(cfg.run_dir), Path(cfg.out)
    found = run_checkpoint(run_dir, cfg.step)
    path, meta, model_cfg = found.path, found.meta, found.config.model
    data_meta = run_dir.read_data_meta("export needs")
    layout(model_cfg)  # a model no transformers class computes: one line, nothing written
    check_out(out, cfg.force)
    tmp = out.with_name(f".{out.name}.partial-{os.getpid()}")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        kind = data_meta["tokenizer"]
        ends = write_tokenizer(tmp, kind, run_dir.path, model_cfg.block_size)
        written = write_model(tmp, found.weights, model_cfg, int(data_meta["vocab_size"]),
                              int(data_meta["eot_id"]), fingerprint(kind, run_dir.path), ends)
        check_out(out, cfg.force)
        publish(tmp, out)
    except OSError as e:
        raise UserError(f"--out {out}: cannot write it ({e.strerror}); give a directory you can "
                        "write to") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"exported {path} (step {meta['step']}) to {out}: {written}, {model_cfg.n_layer} "
          f"layers × {model_cfg.n_embd} wide, {data_meta['vocab_size']:,} ids, {kind} tokenizer")


def write_model(out: Path, weights: dict, model: ModelConfig, vocab: int, eot: int,
                tokenizer_fingerprint: str, ends: list[int] | None = None) -> str:
    """config.json, generation_config.json and model.safetensors for the transformers class that
    computes `model` (its name is returned): GPT2LMHeadModel for learned positions (gpt2.py's
    layout), Qwen3ForCausalLM, LlamaForCausalLM or ApertusForCausalLM for rotary ones
    (llama.py's); a model that none computes exactly is refused in one line naming the setting.
    `ends`: the ids generation stops at (a chat model's <|assistant_end|> too; else eot)."""
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    transformers = require("transformers", "export", "ddpgpt export")
    model, name = model.resolved(), layout(model)
    if model.rope:
        kind = llama.family(model)
        make = getattr(transformers, llama.CONFIGS[kind], None)
        if make is None:
            raise UserError(f"transformers {transformers.__version__} has no "
                            f"{llama.CLASSES[kind]}, the class that computes this model; "
                            "upgrade it (pip install -U transformers) to export")
        make(
            **llama.config(model, vocab), bos_token_id=eot, eos_token_id=eot,
            architectures=[llama.CLASSES[kind]], ddpgpt={"tokenizer": tokenizer_fingerprint}
        ).save_pretrained(str(out))
        tensors = llama.to_llama(weights, model, vocab)
    else:
        transformers.GPT2Config(
            vocab_size=vocab, n_positions=model.block_size, n_embd=model.n_embd,
            n_layer=model.n_layer, n_head=model.n_head,
            activation_function=gpt2.ACTIVATION[model.gelu],
            resid_pdrop=model.dropout, embd_pdrop=model.dropout, attn_pdrop=model.dropout,
            layer_norm_epsilon=model.norm_eps, bos_token_id=eot, eos_token_id=eot,
            tie_word_embeddings=True, architectures=["GPT2LMHeadModel"],
            ddpgpt={"tokenizer": tokenizer_fingerprint, "bias": model.bias}
        ).save_pretrained(str(out))
        tensors = gpt2.to_gpt2(weights, vocab, model.bias)
    GenerationConfig(bos_token_id=eot, eos_token_id=ends if ends else eot,
                     pad_token_id=eot).save_pretrained(str(out))
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    as_created(out / "model.safetensors")
    return name


def layout(model: ModelConfig) -> str:
    """The transformers class that computes `model` exactly, or one line naming the setting that
    none does."""
    model = model.resolved()
    if model.rope:
        return llama.CLASSES[llama.family(model)]
    gpt2.check_model(model)
    return "GPT2LMHeadModel"


def write_tokenizer(out: Path, kind: str, run_dir, max_length: int) -> list[int] | None:
    """The run's tokenizer as transformers' PreTrainedTokenizerFast files (`run_dir`: a local
    directory or the URL of a run's checkpoints, which holds its tokenizer.json too); with the
    chat template's tokens (a fine-tuned run's), the template too, and the ids a reply ends at
    (<|assistant_end|>, end-of-text) are returned (else None)."""
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast

    special = {"bos_token": EOT_TEXT, "eos_token": EOT_TEXT, "unk_token": EOT_TEXT,
               "model_max_length": max_length}
    base = base_kind(kind)
    if base == "bpe":
        tok = BPETokenizer.load(run_dir).backend
    elif base == "byte":
        tok = byte_tokenizer()
    elif base == "gpt2":
        tok = gpt2_tokenizer()
    else:
        raise UserError(f"run {run_dir}: unknown tokenizer {kind!r} in data_meta.json")
    if kind != base:  # byte+chat, gpt2+chat: the template's tokens after the base's ids
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t in chat.TOKENS])
    ids = {t: tok.token_to_id(t) for t in chat.TOKENS}
    templated = not chat.missing({t: i for t, i in ids.items() if i is not None})
    if templated:
        special.update(chat_template=chat.JINJA, additional_special_tokens=list(chat.TOKENS))
    PreTrainedTokenizerFast(tokenizer_object=tok, **special).save_pretrained(str(out))
    return [ids["<|assistant_end|>"], tok.token_to_id(EOT_TEXT)] if templated else None


def byte_tokenizer():
    """ddpgpt's byte tokenizer as a HF `tokenizers` one: GPT-2's byte-to-character map, a BPE
    with each byte's character as its id and no merges, end-of-text 256."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {char: byte for byte, char in bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(EOT_TEXT, special=True, normalized=False)])
    return tok


def gpt2_tokenizer():
    """GPT-2's tokenizer: from tiktoken's encoding when it is cached, else the hub's files."""
    try:
        import tiktoken
        enc = tiktoken.get_encoding("gpt2")
    except Exception:
        enc = None
    if enc is not None:
        return from_tiktoken(enc)
    from huggingface_hub import hf_hub_download
    from tokenizers import Tokenizer

    repo = gpt2.HUB["gpt2"][0]
    try:
        return Tokenizer.from_file(hf_hub_download(repo, "tokenizer.json"))
    except Exception as e:
        raise UserError(f"cannot get GPT-2's tokenizer: tiktoken's gpt2 encoding is not cached "
                        f"and {repo} cannot be downloaded ({type(e).__name__}: no network?); "
                        "point TIKTOKEN_CACHE_DIR at the cache ddpgpt prepare --tokenizer gpt2 "
                        "filled, or HF_HOME at a Hugging Face cache that holds "
                        f"{repo}") from None


def from_tiktoken(enc):
    """A tiktoken encoding as a HF `tokenizers` one with the same ids (transformers' own
    converter: every merge that can make each token, in rank order; the special tokens after)."""
    from transformers.convert_slow_tokenizer import TikTokenConverter

    specials = sorted(enc._special_tokens, key=enc._special_tokens.get)
    converter = TikTokenConverter(pattern=enc._pat_str, extra_special_tokens=specials)
    converter.load_tiktoken_bpe = lambda _: enc._mergeable_ranks
    return converter.converted()

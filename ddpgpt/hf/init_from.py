"""`--init-from`: start training from GPT-2's weights, any GPT-2-layout checkpoint, or a small
open model of the Llama family (Llama, Qwen3, Apertus).

    ddpgpt train --data data/owt --init-from gpt2 --data.seq-len 256   # hub: needs the network once
    ddpgpt train --data data/mine --init-from exported/                 # a transformers directory
    ddpgpt train --data data/mine --init-from weights.safetensors --model.n-head 12
    ddpgpt train --data data/mine --init-from exported-modern/  # Qwen3ForCausalLM, LlamaForCausalLM

Three steps, at three times:
1. the shape (`apply_shape`, while the config is built): layers, width, positions, vocabulary
   and the architecture's pieces come from the weights (GPT-2's: model.arch gpt2 and its GELU;
   a Llama, Qwen3 or Apertus config.json: model.arch modern with its heads, key/value heads,
   head width, MLP and its width, rotary base, norm epsilon, biases, tying and QK-norm); a shape
   the user set that disagrees is one line. The vocabulary is padded as a dataset's would be
   (GPT-2's 50,257 ids -> 50,304 rows) and `model.vocab_limit` masks the padding rows.
2. the tokenizer (`check_tokenizer`, in preflight): the dataset's must be the weights' — gpt2 for
   the hub names; for a directory the one saved beside the weights (config.json's `ddpgpt` entry
   from `ddpgpt export`, else GPT-2's if its files are GPT-2's or there are none and the
   vocabulary has GPT-2's 50,257 ids, else the sha256 of its tokenizer.json).
3. the weights (`read_state`, on every rank, only when the run starts from scratch: a resumed
   run continues from its own checkpoints). The ranks' parameter digests are then compared as
   for any start, so every rank provably read the same weights.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from ddpgpt.config.checks import ConfigError
from ddpgpt.config.model import ARCHS, Pieces
from ddpgpt.config.schema import TrainConfig, padded_vocab
from ddpgpt.data.tokenizer import GPT2_VOCAB, fingerprint, folder_tokenizer, grows_by_chat
from ddpgpt.errors import UserError, warn
from ddpgpt.hf import gpt2, llama

HUB_FILES = ["config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
             "tokenizer_config.json", "vocab.json", "merges.txt"]


def locate(spec: str) -> Path:
    """The local directory or file of `spec`; a hub name is looked up in the Hugging Face cache
    first, then downloaded (once, for every later run)."""
    if spec not in gpt2.HUB:
        path = Path(spec)
        if not path.exists():
            names = ", ".join(gpt2.HUB)
            raise UserError(f"--init-from {spec}: no such file or directory, and not one of "
                            f"{names}; give a transformers directory or a .safetensors file")
        return path
    from huggingface_hub import snapshot_download

    repo = gpt2.HUB[spec][0]
    try:
        return Path(snapshot_download(repo, allow_patterns=HUB_FILES, local_files_only=True))
    except Exception:
        pass  # not cached: download
    try:
        return Path(snapshot_download(repo, allow_patterns=HUB_FILES))
    except Exception as e:
        raise UserError(f"--init-from {spec}: {repo} is not in the Hugging Face cache and cannot "
                        f"be downloaded ({type(e).__name__}: no network?); download it where "
                        f"there is one (hf download {repo} --local-dir {spec}) and pass that "
                        f"directory: --init-from ./{spec}") from None


def read_config(path: Path) -> dict | None:
    """config.json beside the weights (in the directory, or beside the file), if any."""
    file = (path if path.is_dir() else path.parent) / "config.json"
    if not file.is_file():
        return None
    try:
        return json.loads(file.read_text())
    except ValueError as e:
        raise UserError(f"{file}: not valid JSON ({e})") from None


def _weight_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / f for f in files]
    for name in ("model.safetensors", "pytorch_model.bin"):
        if (path / name).is_file():
            return [path / name]
    raise UserError(f"--init-from {path}: no model.safetensors (or pytorch_model.bin) in it; give "
                    "a directory that transformers' save_pretrained wrote, or a .safetensors file")


def _shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape, from the safetensors headers alone (no weights are read)."""
    from safetensors import safe_open

    shapes = {}
    for file in _weight_files(path):
        if file.suffix != ".safetensors":
            state = torch.load(file, map_location="meta", weights_only=True)
            shapes.update({k: tuple(v.shape) for k, v in state.items()})
            continue
        try:
            with safe_open(str(file), "pt") as f:
                shapes.update({k: tuple(f.get_slice(k).get_shape()) for k in f.keys()})
        except Exception as e:  # safetensors raises its own error types for bad files
            raise UserError(f"--init-from {file}: not a readable safetensors file ({e})") from None
    return shapes


def weights_shape(spec: str) -> dict:
    """The model fields the weights `spec` fix (n_layer, n_head when known, n_embd, block_size,
    bias, ...; for Llama and Qwen3 every piece of the architecture) and `vocab`, unpadded."""
    if spec in gpt2.HUB:
        _, n_layer, n_head, n_embd = gpt2.HUB[spec]
        return {"n_layer": n_layer, "n_head": n_head, "n_embd": n_embd,
                "block_size": gpt2.GPT2_POSITIONS, "vocab": GPT2_VOCAB, "bias": True,
                "gelu": "tanh"}
    path = locate(spec)
    config = read_config(path)
    if config is not None and config.get("model_type") in llama.CLASSES:
        return llama.shape(config, f"--init-from {spec}")
    if config is not None:
        gpt2.check_config(config, f"--init-from {spec}")
    shapes = gpt2.strip_prefix(_shapes(path))
    if "blocks.0.attn.qkv.weight" in shapes:
        raise UserError(f"--init-from {spec}: these are a ddpgpt checkpoint's weights; continue "
                        "that run with --resume PATH (and --data.allow-switch for new data), or "
                        "export it first: ddpgpt export --run-dir RUN --out DIR")
    try:
        return gpt2.shape(shapes, config)
    except ValueError:
        raise UserError(f"--init-from {spec}: not GPT-2 weights (no wte.weight and wpe.weight)"
                        ) from None


def gpt2_pieces(found: dict) -> dict:
    """GPT-2's architecture as fields the weights fix: model.arch gpt2's pieces, and the widths
    that follow from its shape."""
    pieces = ARCHS["gpt2"]._asdict()
    del pieces["bias"], pieces["zero_init_proj"]  # the weights say the first; the second is init
    pieces.update(arch="gpt2", mlp_hidden=4 * found["n_embd"])
    if "n_head" in found:
        pieces.update(n_kv_head=found["n_head"], head_dim=found["n_embd"] // found["n_head"])
    return pieces


def apply_shape(cfg: TrainConfig, explicit: dict[str, str]) -> TrainConfig:
    """cfg with the model shape and architecture of its --init-from weights. `explicit`: the
    model fields the user set, each with where (a TOML file, the command line); those must agree
    with the weights."""
    spec = cfg.model.init_from
    want = dict(weights_shape(spec))
    vocab = want.pop("vocab")
    if "arch" not in want:
        want.update(gpt2_pieces(want))
    want.update(vocab_size=padded_vocab(vocab), vocab_limit=vocab)
    if "n_head" not in want and "n_head" not in explicit:
        raise UserError(f"--init-from {spec}: no config.json beside the weights says how many "
                        "attention heads they have; give --model.n-head")
    conflicts = []
    for name, value in want.items():
        if name not in explicit:
            continue
        mine = getattr(cfg.model, name)
        if name == "vocab_size":  # a wider padded vocabulary is fine
            ok = mine >= vocab
        else:  # no biases where the weights' are zero; the padding mask's start is the user's
            ok = mine == value or (name == "bias" and not mine) or name == "vocab_limit"
        if ok:
            want[name] = mine
        else:
            conflicts.append(f"model.{name} = {mine} ({explicit[name]}) but the weights have "
                             f"{vocab if name == 'vocab_size' else value}")
    if conflicts:
        hint = (" (train on shorter sequences with --data.seq-len)"
                if any(c.startswith("model.block_size") for c in conflicts) else "")
        raise ConfigError(f"--init-from {spec}: {'; '.join(conflicts)}; leave the shape out, it "
                          f"comes from the weights{hint}")
    model = dataclasses.replace(cfg.model, **want)
    return dataclasses.replace(cfg, model=model)


def shape_note(before: TrainConfig, after: TrainConfig) -> str:
    """The line that says what the weights of --init-from changed of the config the preset, file
    and flags made (`before`: its model section, as `after`'s was before the weights' shape):
    each model field, and T with the tokens per step when the context length moved (T is the
    data's: data.seq_len, or the block size)."""
    mine, theirs = before.model.resolved(), after.model.resolved()
    skip = {"init_from", "vocab_limit"}
    if mine.arch != theirs.arch:  # its pieces, and the widths that follow them, with it
        skip |= {*Pieces._fields, "mlp_hidden", "n_kv_head", "head_dim"}
    fields = [f"{name} {getattr(mine, name)} -> {getattr(theirs, name)}"
              for name in dataclasses.asdict(mine) if name not in skip and getattr(mine, name)
              and getattr(mine, name) != getattr(theirs, name)]
    line = f"ddpgpt: --init-from {after.model.init_from}: "
    line += ("the model's shape from its weights: " + ", ".join(fields) if fields else
             "the model's shape is its weights'")
    G, T0, T = after.data.global_batch, after.data.seq_len or mine.block_size, after.seq_len
    if T != T0:
        line += f"; T {T0} -> {T}: G={G} × T={T} = {G * T:,} tokens per step (was {G * T0:,})"
    return line


def loaded(spec: str, state: dict[str, torch.Tensor]) -> str:
    """The line that says what --init-from read."""
    count = sum(t.numel() for t in state.values())
    return f"ddpgpt: started from the weights of {spec}: {count / 1e6:.2f}M parameters"


ASSUMED_GPT2 = "no tokenizer files beside the weights; their 50,257 ids taken for GPT-2's"


def weights_tokenizer(spec: str) -> tuple[str | None, str]:
    """The fingerprint (data.tokenizer.fingerprint) of the tokenizer the weights were trained
    with, or None when nothing beside them says; and a note when it is an assumption."""
    if spec in gpt2.HUB:
        return "gpt2", ""
    path = Path(spec)
    folder = path if path.is_dir() else path.parent
    read_config(path)  # a config.json that is not JSON: its own line
    found = folder_tokenizer(folder, f"--init-from {folder}")
    if found is not None or any((folder / n).is_file() for n in ("tokenizer.json", "vocab.json")):
        return found, ""
    if weights_shape(spec)["vocab"] == GPT2_VOCAB:
        return "gpt2", ASSUMED_GPT2
    return None, ""


def check_tokenizer(cfg: TrainConfig, dataset) -> None:
    """The dataset was made with the tokenizer of the --init-from weights, or one line. The
    tokenizer.json saved beside them is theirs too: a dataset prepared with it (`prepare
    --tokenizer-from` the directory) fits, whatever the fingerprint config.json records (`ddpgpt
    export` saves the run's tokenizer through transformers, which writes it anew); so does it
    with the chat template's tokens added (`prepare --chat`: the vocabulary grows)."""
    spec = cfg.model.init_from
    (theirs, note), ours = weights_tokenizer(spec), dataset.tokenizer_fingerprint
    folder = Path(spec) if Path(spec).is_dir() else Path(spec).parent
    if theirs is None:
        raise UserError(f"--init-from {spec}: no tokenizer beside the weights (tokenizer.json or "
                        "vocab.json) tells what their ids mean; put the one they were trained "
                        "with there (ddpgpt export does)")
    beside = fingerprint("bpe", folder) if spec not in gpt2.HUB and \
        (folder / "tokenizer.json").is_file() else None
    grown = grows_by_chat((theirs.partition(":")[0], folder), (dataset.tokenizer, dataset.path))
    if ours not in (theirs, beside) and not grown:  # (grown: the vocabulary grows, init_weights)
        how = ("prepare the data with --tokenizer gpt2" if theirs == "gpt2" else
               f"prepare the data with theirs: ddpgpt prepare SOURCES --tokenizer-from {folder} "
               "--out DIR")
        raise UserError(f"--init-from {spec}: the weights' tokenizer ({_short(theirs)}"
                        f"{'; ' + note if note else ''}) is not the one of data.dir = "
                        f"{cfg.data.dir} ({_short(ours)}): its ids would mean other text; {how}")
    if note:
        warn(f"--init-from {spec}: {note}")


def _short(fp: str) -> str:
    kind, _, digest = fp.partition(":")
    return f"{kind} {digest[:12]}" if digest else kind


def read_weights(spec: str) -> dict[str, torch.Tensor]:
    """Every tensor of the weights `spec`, names as they are stored."""
    from safetensors.torch import load_file

    tensors = {}
    for file in _weight_files(locate(spec)):
        if file.suffix == ".safetensors":
            tensors.update(load_file(str(file)))
        else:
            tensors.update(torch.load(file, map_location="cpu", weights_only=True))
    return tensors


def read_state(spec: str, cfg) -> dict[str, torch.Tensor]:
    """Our state dict for a model of shape `cfg` (a ModelConfig) from the weights `spec`: GPT-2's
    layout (gpt2.py) or Llama's and Qwen3's (llama.py)."""
    tensors, cfg = read_weights(spec), cfg.resolved()
    try:
        if "model.embed_tokens.weight" in tensors:
            state = llama.from_llama(tensors, cfg)
        else:
            state = gpt2.from_gpt2(gpt2.strip_prefix(tensors), cfg.vocab_size, cfg.bias)
    except KeyError as e:
        raise UserError(f"--init-from {spec}: the weights have no {e}; were they changed since "
                        "the run was configured?") from None
    layers = sum(1 for name in state if name.endswith("attn.qkv.weight"))
    qkv = (cfg.n_head + 2 * cfg.n_kv_head) * cfg.head_dim
    shapes = {"wte.weight": (cfg.vocab_size, cfg.n_embd),
              "blocks.0.attn.qkv.weight": (qkv, cfg.n_embd),
              "blocks.0.mlp.fc.weight": (cfg.mlp_hidden, cfg.n_embd)}
    if not cfg.rope:
        shapes["wpe.weight"] = (cfg.block_size, cfg.n_embd)
    if layers != cfg.n_layer or any(state[n].shape != s for n, s in shapes.items()):
        raise UserError(f"--init-from {spec}: the weights do not have the run's shape ("
                        f"{cfg.n_layer} layers of {cfg.n_embd}, {cfg.n_head} heads of "
                        f"{cfg.head_dim}, an MLP of {cfg.mlp_hidden}, {cfg.block_size} "
                        "positions); were they changed since the run was configured?")
    return state

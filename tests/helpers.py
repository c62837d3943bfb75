"""Shared test helpers: small datasets written through the real shard and meta code, and the
references tests compare with (processes started and watched: tests/processes.py)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from ddpgpt.config.model import ModelConfig
from ddpgpt.data.prepare.assemble import SplitWriter
from ddpgpt.data.prepare.finish import make_meta
from ddpgpt.data.shards import dtype_for_vocab

REPO = Path(__file__).resolve().parent.parent
# GPT-2's vocab.bpe and encoder.json in tiktoken's cache layout, beside the repository (a CI
# clone has ../shared too); the gpt2 cases are skipped without it.
TIKTOKEN_GPT2 = REPO.parent / "shared" / "data" / "tiktoken-gpt2"
# unit tests' model: GPT-2's architecture (the tests of the modern one replace arch)
SMALL = ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64, arch="gpt2")


def write_dataset(path: Path, train: np.ndarray, val: np.ndarray, vocab_size: int,
                  shard_tokens: int = 10**9, eot_id: int = 0, kind: str = "byte",
                  masks: tuple[np.ndarray, np.ndarray] | None = None) -> Path:
    """A dataset dir holding exactly these token streams (split into shards of `shard_tokens`),
    under the tokenizer name `kind` (gpt2: GPT-2's ids, made without its tokenizer files). Its
    meta.json has no byte counts, as datasets prepared before they were recorded. `masks`:
    (train, val) loss masks beside them, as a dataset of conversations has."""
    path.mkdir(parents=True, exist_ok=True)
    dtype = dtype_for_vocab(vocab_size)
    shards, mask_shards = {}, {} if masks is not None else None
    for i, (split, tokens) in enumerate((("train", train), ("val", val))):
        writer = SplitWriter(path, split, dtype, shard_tokens)
        writer.write(np.asarray(tokens))
        shards[split] = writer.close()
        if masks is not None:
            writer = SplitWriter(path, split, "uint8", shard_tokens, mask=True)
            writer.write(np.asarray(masks[i], dtype=np.uint8))
            mask_shards[split] = writer.close()
    tok = SimpleNamespace(kind=kind, vocab_size=vocab_size, eot_id=eot_id)
    meta = make_meta(tok, dtype, shards, {"specs": ["test"]}, masks=mask_shards)
    (path / "meta.json").write_text(json.dumps(meta))
    return path


def write_conversations(path: Path, n: int, seed: int = 0) -> Path:
    """`n` conversations as jsonl (`prepare --chat`'s input): arithmetic questions and their
    answers, a system turn in some, a second exchange in others, of varied lengths (from ~30 to
    ~110 bytes), so that rows of 33 tokens hold varied numbers of the assistant's tokens."""
    rng = np.random.default_rng(seed)
    lines = []
    for i in range(n):
        a, b = (int(v) for v in rng.integers(0, 100, 2))
        messages = [{"role": "user", "content": f"What is {a}+{b}?"},
                    {"role": "assistant", "content": f"{a}+{b} is {a + b}."}]
        if i % 3 == 0:
            messages.insert(0, {"role": "system", "content": "Answer in one short line."})
        if i % 4 == 1:
            messages += [{"role": "user", "content": "And twice that?"},
                         {"role": "assistant", "content": f"Twice {a + b} is {2 * (a + b)}."}]
        lines.append(json.dumps({"messages": messages}))
    path.write_text("\n".join(lines) + "\n")
    return path


def json_error(text: str) -> str:
    """How the readers quote a JSON parse error: "JSONDecodeError: <message>"."""
    try:
        json.loads(text)
    except ValueError as e:
        return f"{type(e).__name__}: {e}"
    raise AssertionError("the text parses")


def assert_greedy_agrees(got, want, logits_of, tie: float = 1e-4) -> None:
    """Two greedy decodings (B, T) of one model by different arithmetic (a KV cache's one-row
    products or the whole context's, ours or transformers'): the same tokens, or, where a row
    first parts, a tie: both tokens' logits within `tie` of the best one, in
    `logits_of(prefix)` (the last position's logits (1, V) of a forward over the prefix). The
    logits agree to ~1e-6, not bitwise, so two best tokens that close may go either way."""
    import torch

    got, want = torch.as_tensor(got), torch.as_tensor(want)
    assert got.shape == want.shape, (got.shape, want.shape)
    for row in range(got.size(0)):
        parted = (got[row] != want[row]).nonzero()
        if len(parted) == 0:
            continue
        k = parted[0].item()
        with torch.no_grad():
            logits = logits_of(want[row:row + 1, :k]).reshape(-1).float()
        gaps = [(logits.max() - logits[t[row, k]]).item() for t in (got, want)]
        assert max(gaps) <= tie, (f"row {row} parts at position {k}: its tokens' logits are "
                                  f"{gaps} below the best, more than a tie ({tie})")


def saved_state(path: Path) -> dict:
    """A checkpoint's whole state on this one process, in the layout Trainer.load_state_dict
    reads (weights, torch's optimizer state_dict over the whole model, every rank's RNG, ...)."""
    from ddpgpt.checkpoint import read, store

    return read.load(Path(path), store.read_meta(Path(path)))


def saved_weights(path: Path) -> dict:
    """A checkpoint's weights, whole, on this one process."""
    from ddpgpt.checkpoint import read

    return read.weights(Path(path))


def save_format_2(root: Path, step: int, state: dict, meta: dict) -> Path:
    """A checkpoint as the store wrote them before format 3: rank 0's whole state in
    model.safetensors and trainer.pt, meta.json with their sha256."""
    import hashlib
    import io

    import torch
    from safetensors.torch import save as save_safetensors

    final = Path(root) / f"step_{step:07d}"
    final.mkdir(parents=True)
    buffer = io.BytesIO()
    torch.save({k: v for k, v in state.items() if k != "model"}, buffer)
    files = {"model.safetensors": save_safetensors({k: v.contiguous()
                                                    for k, v in state["model"].items()}),
             "trainer.pt": buffer.getvalue()}
    for name, data in files.items():
        (final / name).write_bytes(data)
    (final / "meta.json").write_text(json.dumps({
        "format_version": 2, "step": step, **meta,
        "files": {n: hashlib.sha256(d).hexdigest() for n, d in files.items()}}))
    return final


def write_run(run: Path, model, kind: str, vocab: int, step: int = 3, seed: int = 1):
    """A run dir as `ddpgpt train` leaves it, without training: `model` (a ModelConfig) built
    from `seed` (its embedding drawn wider, as trained rows differ), one checkpoint at `step`,
    config.json, the data's meta.json (tokenizer `kind`, `vocab` ids). Returns the weights."""
    import torch

    from ddpgpt.config.schema import TrainConfig
    from ddpgpt.data.tokenizer import fingerprint
    from ddpgpt.model.gpt import GPT

    cfg = TrainConfig(model=model)
    net = GPT(model, seed=seed)
    with torch.no_grad():
        net.wte.weight.normal_(generator=torch.Generator().manual_seed(seed))
    (run / "checkpoints").mkdir(parents=True)
    save_format_2(run / "checkpoints", step, {"model": net.state_dict()},
                  {"config": cfg.to_dict(), "world_size": 1,
                   "tokenizer_fingerprint": fingerprint(kind, run)})
    (run / "config.json").write_text(json.dumps(cfg.to_dict()))
    (run / "data_meta.json").write_text(json.dumps({"tokenizer": kind, "vocab_size": vocab,
                                                    "eot_id": 256}))
    return net.state_dict()


def reference_step(stream: np.ndarray, seed: int, seq_len: int, G: int, k: int,
                   version: int = 2) -> np.ndarray:
    """Step k's G windows, shape (G, T+1), straight from the documented ordering rule: the
    epoch's order (data/order.py, itself tested against a scalar oracle in test_order.py), the
    next G positions of it, no window twice."""
    from ddpgpt.data.order import epoch_order

    n = (len(stream) - 1) // seq_len
    epoch, pos = divmod(k, n // G)
    windows = epoch_order(n, seed, epoch, version=version)(np.arange(pos * G, (pos + 1) * G))
    return np.stack([stream[w * seq_len:w * seq_len + seq_len + 1] for w in windows])


def read_metrics(run_dir: Path) -> tuple[list[dict], list[dict]]:
    """(train rows, eval rows) of a run's metrics.jsonl."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "loss" in r], [r for r in rows if "val_loss" in r]


def tiny_train_args(data: Path, run_dir: Path, steps: int = 6, **overrides) -> list[str]:
    """`-m ddpgpt train` with a 2-layer, 32-wide model, T=32, G=8 sequences, b=2."""
    args = {"--data": data, "--run-dir": run_dir, "--model.n-layer": 2, "--model.n-head": 2,
            "--model.n-embd": 32, "--model.block-size": 32, "--data.micro-batch": 2,
            "--data.global-batch": 8, "--data.eval-windows": 16, "--run.steps": steps,
            "--optim.warmup-steps": 2, "--optim.lr": 1e-2, "--run.eval-every": 0,
            "--run.checkpoint-every": 3, "--device": "cpu", "--run.threads": 1}
    args.update({f"--{k.replace('__', '.').replace('_', '-')}": v for k, v in overrides.items()})
    return ["-m", "ddpgpt", "train"] + [str(x) for kv in args.items() for x in kv]


def reference_training(data_dir: Path, steps: int, G: int = 8, T: int = 32,
                       batches: list[int] | None = None, lr_scale: list[float] | None = None,
                       weights_at: int | None = None, skip: tuple[int, ...] = ()):
    """The oracle for `tiny_train_args` runs: plain PyTorch, one process, the full global batch of
    step k (from the documented order) in one forward and one backward. Returns (losses,
    weights after `weights_at` steps, by default all of them). `batches[k]`: the global batch
    step k takes instead (a rollback skipped some); `lr_scale[k]`: a factor on step k's learning
    rate; `skip`: the steps (0-based) whose update is skipped."""
    import torch

    from ddpgpt.config.model import ModelConfig
    from ddpgpt.config.optim import OptimConfig
    from ddpgpt.config.schema import padded_vocab
    from ddpgpt.data.shards import TokenDataset
    from ddpgpt.model.gpt import GPT
    from ddpgpt.optim.schedule import lr_at

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks run; restored below for the rest of the session
    ds = TokenDataset(data_dir)
    stream = np.concatenate(ds.tokens("train")).astype(np.int64)
    # the model the runs build: the dataset's vocabulary as preflight resolves it
    model = GPT(ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=32,
                            vocab_size=padded_vocab(ds.vocab_size)), seed=1337)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    ocfg = OptimConfig(lr=1e-2, warmup_steps=2)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=ocfg.lr, betas=(0.9, 0.95), eps=1e-8)
    losses = []
    for k in range(steps):
        batch = torch.from_numpy(reference_step(stream, 1337, T, G, batches[k] if batches else k))
        logits = model(batch[:, :-1])[0]
        loss = torch.nn.functional.cross_entropy(logits.view(-1, logits.size(-1)),
                                                 batch[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for group in opt.param_groups:
            group["lr"] = lr_at(k, ocfg, steps) * (lr_scale[k] if lr_scale else 1.0)
        if k not in skip:
            opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if k + 1 == (weights_at or steps):
            weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    torch.set_num_threads(threads)
    return losses, weights



"""`ddpgpt train`: one code path for one process, N local processes, and many nodes.

    ddpgpt train --data data/stdlib --preset tiny                      # one process (CPU or a GPU)
    ddpgpt train --data data/stdlib --preset tiny --nproc 2            # 2 local processes
    torchrun --standalone --nproc_per_node 8 -m ddpgpt train --data data/fineweb --preset gpt2-124m
    torchrun --nnodes 2 --nproc_per_node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        -m ddpgpt train --data data/fineweb --preset gpt2-124m
    ddpgpt train --data data/stdlib --preset tiny --run.steps 20 --device cpu   # a tiny CPU run

The global batch G (data.global_batch sequences) is fixed by the config; with W processes of
micro-batch b, each optimizer step accumulates A = G / (W·b) micro-steps. The windows of step k
depend only on (seed, T, G, k), so the optimizer takes the same steps whatever W is.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from ddpgpt import __version__, checkpoint, dist
from ddpgpt.config import ConfigError, TrainConfig, resolve
from ddpgpt.data.loader import EvalLoader, TrainLoader
from ddpgpt.data.shards import TokenDataset
from ddpgpt.errors import UserError
from ddpgpt.evaluate import evaluate
from ddpgpt.metrics import Metrics, peak_flops
from ddpgpt.model import GPT
from ddpgpt.optim import lr_at, make_optimizer, set_lr

# ---- checks that need no process group --------------------------------------------------------

def accum_steps(cfg: TrainConfig, world_size: int) -> int:
    """A = G / (W·b), or a ConfigError naming all four numbers."""
    G, b, W = cfg.data.global_batch, cfg.data.micro_batch, world_size
    if G % (W * b):
        raise ConfigError(f"data.global_batch = {G} is not divisible by world size {W} × data.micro_batch "
                          f"{b} = {W * b}; make the global batch a multiple of {W * b} or change the micro-batch")
    return G // (W * b)


def for_dataset(cfg: TrainConfig, dataset: TokenDataset) -> TrainConfig:
    """The config with the dataset-dependent fields resolved: vocab size and sequence length."""
    vocab = cfg.model.vocab_size or -(-dataset.vocab_size // 64) * 64
    if vocab < dataset.vocab_size:
        raise ConfigError(f"dataset {dataset.path} has a vocabulary of {dataset.vocab_size} but model.vocab_size "
                          f"= {vocab}; set model.vocab_size >= {dataset.vocab_size} (or 0 to follow the dataset)")
    model = dataclasses.replace(cfg.model, vocab_size=vocab)
    data = dataclasses.replace(cfg.data, seq_len=cfg.seq_len)
    return dataclasses.replace(cfg, model=model, data=data)


def precision(cfg: TrainConfig, device: torch.device) -> str:
    p = cfg.run.precision
    if p == "auto":
        return "bf16" if device.type == "cuda" else "fp32"
    if p == "fp16" and device.type != "cuda":
        raise ConfigError("run.precision = fp16 needs CUDA; use bf16 or fp32 on CPU")
    return p


def autocast_for(cfg: TrainConfig, device: torch.device):
    """A context factory: autocast to bf16/fp16, or nothing for fp32."""
    p = precision(cfg, device)
    if p == "fp32":
        return contextlib.nullcontext
    dtype = torch.bfloat16 if p == "bf16" else torch.float16
    return functools.partial(torch.autocast, device.type, dtype=dtype)


def build_model(cfg: TrainConfig, device: torch.device) -> GPT:
    """The same weights on every rank: drawn from run.seed by a private generator, never from a
    global RNG that some code might have seeded per rank."""
    return GPT(cfg.model, seed=cfg.run.seed).to(device)


# ---- the trainer's state -------------------------------------------------------------------

@dataclass
class Trainer:
    cfg: TrainConfig
    env: dist.DistEnv
    dataset: TokenDataset
    raw: GPT                  # the single-device model: saved, evaluated
    model: torch.nn.Module    # what trains: raw, or DDP(raw), possibly compiled
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler | None
    loader: TrainLoader
    val: EvalLoader
    accum: int
    autocast: object
    step: int = 0
    elapsed_s: float = 0.0

    @property
    def run_dir(self) -> Path:
        return Path(self.cfg.run.dir)


def setup(cfg: TrainConfig, env: dist.DistEnv, dataset: TokenDataset, accum: int) -> Trainer:
    dev = env.device
    torch.set_num_threads(cfg.run.threads or max(1, len(os.sched_getaffinity(0)) // env.local_world_size))
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    # 1. Model and optimizer, identical on every rank.
    raw = build_model(cfg, dev)
    optimizer = make_optimizer(raw, cfg.optim, dev)
    scaler = torch.amp.GradScaler("cuda") if precision(cfg, dev) == "fp16" else None
    # 2. This rank's share of the data; the order is the loader's, not a per-rank seed's.
    loader = TrainLoader(dataset, seq_len=cfg.seq_len, micro_batch=cfg.data.micro_batch, world_size=env.world_size,
                         rank=env.rank, accum_steps=accum, seed=cfg.data.seed, shuffle=cfg.data.shuffle, device=dev)
    val = EvalLoader(dataset, seq_len=cfg.seq_len, micro_batch=cfg.data.micro_batch, world_size=env.world_size,
                     rank=env.rank, max_windows=cfg.data.eval_windows, device=dev)
    t = Trainer(cfg, env, dataset, raw, raw, optimizer, scaler, loader, val, accum, autocast_for(cfg, dev))
    # 3. Resume before wrapping, so DDP sees the final weights.
    found = find_resume(cfg)
    if found:
        restore(t, *found)
    else:
        torch.manual_seed(cfg.run.seed + 1 + env.rank)  # dropout masks differ per rank; weights do not
    # 4. DDP first, then compile: dynamo's DDPOptimizer then splits the graph at DDP's bucket
    #    boundaries, so each bucket's all-reduce overlaps the rest of the backward.
    t.model = dist.wrap_model(raw, env, cfg.run.bucket_mb)
    if cfg.run.compile:
        t.model = torch.compile(t.model)
    # 5. Every rank holds the same weights, config, data and code, or all stop together.
    dist.agree(env, {
        "the parameters after wrapping": (dist.params_digest(raw), "every rank must build the model from the same "
                                          "seed (run.seed); do not seed ranks differently before init"),
        "the resolved config": (dist.digest(json.dumps(cfg.to_dict(), sort_keys=True)),
                                "start every rank with the same command line and config file"),
        "the dataset (meta.json)": (bytes.fromhex(dataset.fingerprint),
                                    "every node must see the same prepared dataset in data.dir"),
        "the ddpgpt and torch versions": (dist.digest(__version__, torch.__version__),
                                          "install the same versions on every node"),
        "the checkpoint to resume from": (dist.digest(str(t.step)),
                                          "put the run dir on a filesystem that every node shares"),
    })
    if env.is_main:
        write_run_files(cfg, dataset)
    return t


def write_run_files(cfg: TrainConfig, dataset: TokenDataset) -> None:
    """config.json (resolved), and the dataset's meta.json and tokenizer, so that `sample` needs
    only the run dir."""
    run_dir = Path(cfg.run.dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(cfg.to_dict(), indent=1) + "\n")
    (run_dir / "data_meta.json").write_bytes(dataset.meta_bytes)
    if (dataset.path / "tokenizer.json").is_file():
        shutil.copyfile(dataset.path / "tokenizer.json", run_dir / "tokenizer.json")


# ---- resume ----------------------------------------------------------------------------------

SHAPE_FIELDS = ("n_layer", "n_head", "n_embd", "block_size", "vocab_size", "bias")


def find_resume(cfg: TrainConfig) -> tuple[Path, dict] | None:
    """The checkpoint to continue from under run.resume (auto, never, or a path), shape-checked."""
    mode = cfg.run.resume
    if mode == "never":
        existing = checkpoint.step_dirs(cfg.run.dir)
        if existing:
            raise UserError(f"run dir {cfg.run.dir} already has checkpoints (up to step {existing[-1][0]}) and "
                            "run.resume = never; use --resume auto to continue, or another --run")
        return None
    if mode == "auto":
        found = checkpoint.find_latest(cfg.run.dir)
    else:
        found = Path(mode), checkpoint.read_meta(Path(mode))
    if found:
        saved = found[1]["config"]["model"]
        diff = [f"{k} {saved[k]} -> {getattr(cfg.model, k)}" for k in SHAPE_FIELDS if saved[k] != getattr(cfg.model, k)]
        if diff:
            raise UserError(f"run dir {cfg.run.dir}: checkpoint {found[0].name} has another model shape "
                            f"({', '.join(diff)}); use another --run to start a new model")
    return found


def restore(t: Trainer, path: Path, meta: dict) -> None:
    """Model, optimizer, loader cursor, step and RNG from checkpoint `path` (on every rank)."""
    checkpoint.load_weights(path, t.raw)
    state = checkpoint.load_trainer_state(path)
    t.optimizer.load_state_dict(state["optimizer"])
    if t.scaler is not None and state.get("scaler"):
        t.scaler.load_state_dict(state["scaler"])
    t.loader.load_state_dict(meta["loader"])
    t.step, t.elapsed_s = int(meta["step"]), float(meta.get("elapsed_s", 0.0))
    rng = state["rng"]
    if meta["world_size"] == t.env.world_size:
        # clone(): set_rng_state crashes (torch 2.13) on a row view with a storage offset.
        torch.set_rng_state(rng["cpu"][t.env.rank].clone())
        if rng.get("cuda") is not None and t.env.device.type == "cuda":
            torch.cuda.set_rng_state(rng["cuda"][t.env.rank].clone(), t.env.device)
    else:  # another W: per-rank streams cannot carry over; start fresh ones from (seed, step, rank)
        torch.manual_seed(t.cfg.run.seed + 1 + t.env.rank + 1_000_003 * t.step)
    if t.env.is_main:
        print(f"resuming from {path} (step {t.step}, saved at world size {meta['world_size']})", file=sys.stderr)


def save(t: Trainer) -> None:
    """Checkpoint at the current step: all ranks gather RNG states, rank 0 writes, all wait."""
    rng = {"cpu": dist.all_gather(t.env, torch.get_rng_state().to(t.env.device)).cpu()}
    if t.env.device.type == "cuda":
        rng["cuda"] = dist.all_gather(t.env, torch.cuda.get_rng_state(t.env.device).to(t.env.device)).cpu()
    if t.env.is_main:
        state = {"optimizer": t.optimizer.state_dict(), "rng": rng,
                 "scaler": t.scaler.state_dict() if t.scaler is not None else None}
        meta = {"loader": t.loader.state_dict(), "config": t.cfg.to_dict(), "world_size": t.env.world_size,
                "elapsed_s": t.elapsed_s, "data_fingerprint": t.dataset.fingerprint}
        checkpoint.save(t.run_dir, t.step, t.raw, state, meta, t.cfg.run.keep_checkpoints)
    dist.barrier(t.env)  # no rank runs ahead (or exits) while rank 0 is still writing


# ---- the step and the loop -------------------------------------------------------------------

def train_step(t: Trainer) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward/backward over this rank's A micro-batches, gradients synced once at the last.
    Returns (this rank's mean loss, the global gradient norm before clipping)."""
    loss_sum = torch.zeros((), device=t.env.device)
    for m, (x, y) in enumerate(t.loader.next_step()):
        # DDP all-reduces only on the last micro-step; before it, gradients accumulate locally.
        with dist.sync_gradients(t.model, enabled=m == t.accum - 1):
            with t.autocast():
                _, loss = t.model(x, y)  # mean over this micro-batch's b·T tokens
            # /A: summed over micro-steps, then averaged over W ranks by DDP, the gradient is that
            # of the mean loss over the global batch (every window has T targets).
            scaled = loss / t.accum
            (t.scaler.scale(scaled) if t.scaler else scaled).backward()
        loss_sum += loss.detach()
    if t.scaler is not None:
        t.scaler.unscale_(t.optimizer)
    # After the sync every rank holds the same gradients, so this is the global norm.
    norm = torch.nn.utils.clip_grad_norm_(t.raw.parameters(), t.cfg.optim.grad_clip or float("inf"))
    return loss_sum / t.accum, norm


def optimizer_step(t: Trainer, lr: float) -> None:
    set_lr(t.optimizer, lr)
    if t.scaler is not None:
        t.scaler.step(t.optimizer)
        t.scaler.update()
    else:
        t.optimizer.step()
    t.optimizer.zero_grad(set_to_none=True)


def _due(step: int, every: int, last: int) -> bool:
    return step == last or (every > 0 and step % every == 0)


def loop(t: Trainer, metrics: Metrics) -> None:
    cfg, env, total = t.cfg, t.env, t.cfg.run.steps
    while t.step < total:
        lr = lr_at(t.step, cfg.optim, total)
        loss, norm = train_step(t)
        # One small all-reduce per step: the logged loss is the global mean, never rank 0's own.
        loss = dist.all_reduce(env, loss.detach().clone(), op="mean")
        optimizer_step(t, lr)
        t.step += 1
        t.elapsed_s = metrics.elapsed_s
        if _due(t.step, cfg.run.log_every, total):
            metrics.log_step(t.step, loss.item(), lr, norm.item())
        with metrics.paused():
            if _due(t.step, cfg.run.eval_every, total):
                metrics.log_eval(t.step, evaluate(t.raw, t.val, env, t.autocast))
            if _due(t.step, cfg.run.checkpoint_every, total):
                save(t)


def run(cfg: TrainConfig) -> None:
    # 1. Everything that needs no process group is checked first: batch arithmetic, data, shapes.
    accum = accum_steps(cfg, dist.detect().world_size)
    dataset = TokenDataset(cfg.data.dir)
    cfg = for_dataset(cfg, dataset)
    # 2. Join the group (W > 1); it is destroyed on every way out of this block.
    with dist.session(cfg.run.device, cfg.run.backend) as env:
        t = setup(cfg, env, dataset, accum)
        tokens_per_step = cfg.data.global_batch * cfg.seq_len
        peak = peak_flops(env.device, torch.bfloat16 if precision(cfg, env.device) != "fp32" else torch.float32)
        metrics = Metrics(env.is_main, t.run_dir, t.step, cfg.run.steps, tokens_per_step,
                          t.raw.flops_per_token(cfg.seq_len), peak, env.world_size, t.elapsed_s)
        if env.is_main:
            print(summary(t), file=sys.stderr)
        try:
            if t.step >= cfg.run.steps and env.is_main:
                print(f"run {cfg.run.dir} is already at step {t.step} of {cfg.run.steps}; "
                      "raise run.steps to train further", file=sys.stderr)
            loop(t, metrics)
        finally:
            metrics.close()


def summary(t: Trainer) -> str:
    """One line on what runs where: processes, nodes, batch arithmetic, model size."""
    env, cfg = t.env, t.cfg
    nodes = env.world_size // env.local_world_size
    where = f"{env.world_size} process{'es' if env.world_size > 1 else ''}"
    if env.world_size > 1:
        where += f" ({nodes} node{'s' if nodes > 1 else ''} × {env.local_world_size}, {env.backend})"
    return (f"ddpgpt: training on {where}, {env.device.type}, {precision(cfg, env.device)}; "
            f"G={cfg.data.global_batch} sequences × T={cfg.seq_len} = {cfg.data.global_batch * cfg.seq_len:,} "
            f"tokens per step = {env.world_size} × A={t.accum} micro-steps × b={cfg.data.micro_batch}; "
            f"{t.raw.num_params() / 1e6:.2f}M parameters")


def main(values: dict, argv: list[str]) -> None:
    """From the command line: resolve and check the config, then train here, or start --nproc
    local workers that run this same command."""
    preset, config_file = values.pop("preset", None), values.pop("config", None)
    nproc, restarts = values.pop("nproc", None), values.pop("max_restarts", 0)
    from ddpgpt.cli import train_overrides
    cfg = resolve(preset, config_file, train_overrides(values))
    if nproc is None:
        return run(cfg)
    if dist.detect().world_size > 1:
        raise UserError("--nproc starts processes itself; under torchrun leave it out")
    if nproc < 1:
        raise ConfigError(f"--nproc {nproc} must be >= 1")
    accum_steps(cfg, nproc)  # fail here, before any worker starts
    for_dataset(cfg, TokenDataset(cfg.data.dir))
    sys.exit(dist.launch(nproc, strip_flags(argv, ("--nproc", "--max-restarts")), restarts))


def strip_flags(argv: list[str], flags: tuple[str, ...]) -> list[str]:
    """argv without `--flag VALUE` / `--flag=VALUE` for each of `flags`."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in flags:
            skip = True
        elif not arg.startswith(tuple(f + "=" for f in flags)):
            out.append(arg)
    return out

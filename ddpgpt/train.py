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

After every step the ranks exchange one small tensor: their loss, whether it and the gradient
norm are finite, and whether a stop signal arrived. From it every rank logs the same global loss,
skips or stops on a non-finite value, and stops for pre-emption, all at the same step.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from ddpgpt import __version__, checkpoint, dist
from ddpgpt.config import ConfigError, TrainConfig
from ddpgpt.data.loader import EvalLoader, TokenStream, TrainLoader
from ddpgpt.data.shards import TokenDataset
from ddpgpt.errors import DataError, UserError, warn
from ddpgpt.evaluate import evaluate
from ddpgpt.faults import Fault
from ddpgpt.metrics import Metrics, peak_flops
from ddpgpt.model import GPT, autocast_for, build_model, precision
from ddpgpt.optim import lr_at, make_optimizer, set_lr
from ddpgpt.preempt import EXIT_PREEMPTED, StopSignal
from ddpgpt.resume import find_resume, reset_run_dir, restore, save, seed_rank_rng

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


def preflight(cfg: TrainConfig, world_size: int) -> tuple[TrainConfig, TokenDataset, int]:
    """Every check that needs no process group, so bad input fails before one exists: batch
    arithmetic, the dataset and its fit to the model and the batch. Returns the resolved config,
    the dataset and A."""
    accum = accum_steps(cfg, world_size)
    dataset = TokenDataset(cfg.data.dir)
    cfg = for_dataset(cfg, dataset)
    T, G = cfg.seq_len, cfg.data.global_batch
    for split, need in (("train", G), ("val", 1)):
        have = TokenStream(dataset, split, T).num_windows
        if have < need:
            raise DataError(f"dataset {dataset.path}: the {split} split has {have} windows of {T + 1} tokens, fewer "
                            f"than {'one global batch of ' if split == 'train' else ''}{need}; use a larger dataset, "
                            "or a smaller data.seq_len" + (" / data.global_batch" if split == "train" else ""))
    return cfg, dataset, accum


def keep_freed_memory() -> None:
    """On CPU with glibc: keep freed memory in the process for reuse (elsewhere a no-op).

    Every step allocates and frees the same large tensors (the (b·T, V) logits, their softmax and
    gradients: 32 MiB each for the tiny preset). glibc serves blocks that large with mmap and
    unmaps them on free, so each step page-faults them in again: ~38k faults, ~8% of a tiny CPU
    step, measured. With mmap and trimming off, freed blocks stay in the heap (+2% peak memory)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4
    libc.mallopt(M_MMAP_MAX, 0)
    libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1)


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
    fault: Fault
    step: int = 0             # optimizer steps completed
    elapsed_s: float = 0.0    # wall time of the run so far, across resumes
    skipped: int = 0          # steps skipped for non-finite values
    last_checkpoint: int = -1

    @property
    def run_dir(self) -> Path:
        return Path(self.cfg.run.dir)


def verify_data(dataset: TokenDataset, env: dist.DistEnv) -> None:
    """Re-hash the shards, each rank a 1/W share; a corrupt shard stops every rank."""
    error = None
    try:
        dataset.verify(part=env.rank, parts=env.world_size)
    except DataError as e:
        error = e
    dist.fail_together(env, error)


def setup(cfg: TrainConfig, env: dist.DistEnv, dataset: TokenDataset, accum: int,
          found: tuple[Path, dict] | None) -> Trainer:
    dev = env.device
    if dev.type == "cpu":
        keep_freed_memory()
    torch.set_num_threads(cfg.run.threads or max(1, len(os.sched_getaffinity(0)) // env.local_world_size))
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    if cfg.data.verify:
        verify_data(dataset, env)
    # 1. Model and optimizer, identical on every rank.
    raw = build_model(cfg, dev)
    optimizer = make_optimizer(raw, cfg.optim, dev)
    scaler = torch.amp.GradScaler("cuda") if precision(cfg, dev) == "fp16" else None
    # 2. This rank's share of the data; the order is the loader's, not a per-rank seed's.
    loader = TrainLoader(dataset, seq_len=cfg.seq_len, micro_batch=cfg.data.micro_batch, world_size=env.world_size,
                         rank=env.rank, accum_steps=accum, seed=cfg.data.seed, shuffle=cfg.data.shuffle, device=dev)
    val = EvalLoader(dataset, seq_len=cfg.seq_len, micro_batch=cfg.data.micro_batch, world_size=env.world_size,
                     rank=env.rank, max_windows=cfg.data.eval_windows, device=dev)
    t = Trainer(cfg, env, dataset, raw, raw, optimizer, scaler, loader, val, accum, autocast_for(cfg, dev),
                Fault.from_env(env.rank, env.restart_count))
    # 3. Resume before wrapping, so DDP sees the final weights.
    if found:
        restore(t, *found)
    else:
        seed_rank_rng(cfg, env.rank)  # dropout masks differ per rank; weights do not
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


# ---- the step and the loop -------------------------------------------------------------------

class Preempted(UserError):
    """The ranks stopped together on a signal after writing a checkpoint."""

    exit_code = EXIT_PREEMPTED
    label = "stopped"


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


def agree_step(t: Trainer, loss: torch.Tensor, norm: torch.Tensor, stop: bool) -> tuple[float, list[int], bool]:
    """The one collective after each step. Returns (the global mean loss, the ranks that saw a
    non-finite loss or gradient norm, whether any rank was asked to stop)."""
    # With fp16 the GradScaler itself skips steps whose gradients overflow; only the loss counts.
    finite = torch.isfinite(loss) & (torch.isfinite(norm) | (t.scaler is not None))
    mine = torch.stack([loss.float(), finite.float(), torch.tensor(float(stop), device=loss.device)])
    every = dist.all_gather(t.env, mine).cpu()  # (W, 3)
    bad = [r for r in range(t.env.world_size) if not every[r, 1]]
    return every[:, 0].mean().item(), bad, bool(every[:, 2].any())


def optimizer_step(t: Trainer, lr: float) -> None:
    set_lr(t.optimizer, lr)
    if t.scaler is not None:
        t.scaler.step(t.optimizer)
        t.scaler.update()
    else:
        t.optimizer.step()
    t.optimizer.zero_grad(set_to_none=True)


def skip_or_stop(t: Trainer, bad: list[int]) -> None:
    """A non-finite loss or gradient norm on `bad` ranks: every rank takes the same branch."""
    where = f"step {t.step + 1}: non-finite loss or gradient norm on rank {', '.join(map(str, bad))}"
    kept = f"step {t.last_checkpoint}" if t.last_checkpoint >= 0 else "none yet"
    if t.cfg.run.on_nonfinite == "stop" or t.skipped >= t.cfg.run.max_skipped:
        why = "" if t.cfg.run.on_nonfinite == "stop" else f" after {t.skipped} skipped steps (run.max_skipped)"
        raise dist.DistError(f"{where}; stopped before the optimizer step{why}. The last checkpoint ({kept}) is "
                             "intact; lower optim.lr or raise optim.warmup_steps, or use --on-nonfinite skip",
                             quiet=not t.env.is_main)
    t.optimizer.zero_grad(set_to_none=True)
    t.skipped += 1
    if t.env.is_main:
        warn(f"{where}; skipped ({t.skipped} of at most {t.cfg.run.max_skipped})")


def _due(step: int, every: int, last: int) -> bool:
    return step == last or (every > 0 and step % every == 0)


def loop(t: Trainer, metrics: Metrics, stop: StopSignal) -> None:
    cfg, env, total = t.cfg, t.env, t.cfg.run.steps
    while t.step < total:
        t.fault.before_step(t.step)
        lr = lr_at(t.step, cfg.optim, total)
        loss, norm = train_step(t)
        loss, bad, stopping = agree_step(t, t.fault.poison(loss, t.step), norm, stop.requested)
        if bad:
            skip_or_stop(t, bad)
        else:
            optimizer_step(t, lr)
        t.step += 1
        t.elapsed_s = metrics.elapsed_s
        if _due(t.step, cfg.run.log_every, total):
            metrics.log_step(t.step, None if bad else loss, lr, None if bad else norm.item())
        with metrics.paused():
            if _due(t.step, cfg.run.eval_every, total):
                metrics.log_eval(t.step, evaluate(t.raw, t.val, env, t.autocast))
            if _due(t.step, cfg.run.checkpoint_every, total) or stopping:
                save(t)
        if stopping and t.step < total:
            raise Preempted(f"stopped at step {t.step} on {stop.name or 'a signal to another rank'}; checkpoint "
                            f"{checkpoint.step_dir(t.run_dir, t.step)} is complete: run the same "
                            "command to resume", quiet=not env.is_main)


def run(cfg: TrainConfig) -> None:
    # 1. Everything that needs no process group is checked first: batch arithmetic, data, resume.
    env0 = dist.detect()
    cfg, dataset, accum = preflight(cfg, env0.world_size)
    found = find_resume(cfg, env0.restart_count)
    # 2. Join the group (W > 1); it is destroyed on every way out of this block.
    with dist.session(cfg.run.device, cfg.run.backend, cfg.run.dist_timeout_s) as env, StopSignal(env.is_main) as stop:
        if cfg.run.resume == "reset" and env.restart_count == 0:
            if env.is_main:
                reset_run_dir(cfg.run.dir)
            dist.barrier(env)
        t = setup(cfg, env, dataset, accum, found)
        tokens_per_step = cfg.data.global_batch * cfg.seq_len
        peak = peak_flops(env.device, torch.bfloat16 if precision(cfg, env.device) != "fp32" else torch.float32)
        # Every rank measures at once; a host hiccup can halve one reading, so take the best.
        peak = dist.all_reduce(env, torch.tensor(peak, device=env.device), op="max").item()
        metrics = Metrics(env.is_main, t.run_dir, t.step, cfg.run.steps, tokens_per_step,
                          t.raw.flops_per_token(cfg.seq_len), peak, env.world_size, t.elapsed_s)
        if env.is_main:
            print(summary(t), file=sys.stderr)
        try:
            if t.step >= cfg.run.steps and env.is_main:
                print(f"run {cfg.run.dir} is already at step {t.step} of {cfg.run.steps}; "
                      "raise run.steps to train further", file=sys.stderr)
            loop(t, metrics, stop)
        except Exception as e:
            if dist.is_collective_failure(e):
                raise dist.collective_failure(e, env, t.step + 1, cfg.run.dist_timeout_s) from None
            raise
        finally:
            metrics.close()
            t.model = t.raw  # no DDP wrapper may outlive the group (see dist.shutdown)


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


def main(cfg: TrainConfig, nproc: int | None, max_restarts: int, argv: list[str]) -> None:
    """From the command line: train here, or start --nproc local workers that run this same
    command (checked here first, so bad input fails before any worker starts)."""
    if nproc is None:
        return run(cfg)
    if nproc < 1:
        raise ConfigError(f"--nproc {nproc} must be >= 1")
    cfg, _, _ = preflight(cfg, nproc)
    find_resume(cfg)
    sys.exit(dist.launch(nproc, argv, ("--nproc", "--max-restarts"), max_restarts, cfg.run.device))

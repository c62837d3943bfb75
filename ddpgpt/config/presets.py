"""Named training configs. Each is a function returning a fresh TrainConfig; flags and TOML files
override any field of it.

    tiny       4 layers, 256 wide, T=256 (~5M params): the CPU demo, minutes on 2 cores
    speedrun   tiny's shape and batch, the fastest recipe to a loss measured on a CPU: the modern
               architecture, Muon with MuonEq-R in fp32, AdamW at 0.1 for the embedding and 4e-3
               for the head, a 200-step cosine (docs/performance.md, "Time to a loss")
    small      6 layers, 384 wide, T=512 (~14M params): a single small GPU, or patient CPUs
    gpt2-124m  12 layers, 768 wide, T=1024, GPT-2's vocabulary and architecture: GPU runs
    gpt2-350m  24 layers, 1024 wide, T=1024, GPT-2's architecture: GPU runs

Every preset but the gpt2 ones trains model.arch modern (the default). None sets optim.min_lr:
the decay ends at a tenth of optim.lr, whatever lr a flag gives.
"""

from __future__ import annotations

from ddpgpt.config.checks import ConfigError
from ddpgpt.config.model import ModelConfig
from ddpgpt.config.optim import OptimConfig
from ddpgpt.config.schema import DataConfig, RunConfig, TrainConfig
from ddpgpt.errors import did_you_mean


def tiny() -> TrainConfig:
    return TrainConfig(
        model=ModelConfig(n_layer=4, n_head=4, n_embd=256, block_size=256),
        data=DataConfig(micro_batch=8, global_batch=16, eval_windows=128),
        optim=OptimConfig(lr=2e-3, warmup_steps=20),
        run=RunConfig(steps=200, eval_every=100, checkpoint_every=100),
    )


def speedrun() -> TrainConfig:
    """The tiny preset's shape and batch, trained the fastest way to a loss measured on a CPU, one
    recipe for every corpus measured (benchmarks/speedrun.py against nanoGPT's 500 AdamW steps on
    the stdlib's bytes, its bpe-4096 tokens, Vim's help and Perl's documentation as bpe-4096
    tokens; docs/performance.md, "Time to a loss"). The modern architecture (rotary positions,
    RMSNorm, QK-norm, SwiGLU, no biases, an untied head, zero-initialized projections; SwiGLU
    rather than ReLU²: the same loss, and the model exports as Qwen3). Muon for the matrices,
    with MuonEq-R (each row of the update at unit norm before Newton-Schulz: 0.05-0.10 lower val
    loss at every evaluation on bpe and prose); AdamW at lr 0.1 for the token embedding (a row
    moves only at its own tokens: at 4e-3 bpe crossed nanoGPT's loss at step 130, at 0.1 at 100)
    and 4e-3 for the head and gains; the cosine over 200 steps after 20 of warmup; Newton-Schulz
    and the whole step in fp32 (bf16 was 0.07-0.13 behind in val loss); on a CPU the pieces'
    elementwise work as compiled kernels (model.kernels compiled: the same losses, a cheaper
    step). Every val window is evaluated every 25 steps (apart from the training seconds:
    metrics.jsonl's train_s).
    Measured (three seeds a side, 1 thread, a 2-core VM): nanoGPT's mean final loss at step 50
    on bytes, 100-110 on bpe, 80-100 on Vim's help and 80-90 on Perl's documentation."""
    return TrainConfig(
        model=ModelConfig(n_layer=4, n_head=4, n_embd=256, block_size=256, arch="modern",
                          kernels="compiled"),
        data=DataConfig(micro_batch=8, global_batch=16, eval_windows=0),
        optim=OptimConfig(name="muon", lr=4e-3, embed_lr=0.1, warmup_steps=20,
                          muon_eq=True, muon_ns_dtype="fp32"),
        run=RunConfig(steps=200, eval_every=25, checkpoint_every=0, precision="fp32"),
    )


def small() -> TrainConfig:
    return TrainConfig(
        model=ModelConfig(n_layer=6, n_head=6, n_embd=384, block_size=512),
        data=DataConfig(micro_batch=16, global_batch=64, eval_windows=256),
        optim=OptimConfig(lr=1e-3, warmup_steps=100),
        run=RunConfig(steps=2000, eval_every=250, checkpoint_every=500),
    )


def gpt2_124m() -> TrainConfig:
    """GPT-2 small: ~0.5M tokens per step (512 sequences of 1024 tokens)."""
    return TrainConfig(
        model=ModelConfig(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=50304,
                          arch="gpt2"),
        data=DataConfig(micro_batch=16, global_batch=512, eval_windows=512),
        optim=OptimConfig(lr=6e-4, warmup_steps=700),
        run=RunConfig(steps=19000, log_every=10, eval_every=250, checkpoint_every=1000),
    )


def gpt2_350m() -> TrainConfig:
    return TrainConfig(
        model=ModelConfig(n_layer=24, n_head=16, n_embd=1024, block_size=1024, vocab_size=50304,
                          arch="gpt2"),
        data=DataConfig(micro_batch=8, global_batch=512, eval_windows=512),
        optim=OptimConfig(lr=3e-4, warmup_steps=700),
        run=RunConfig(steps=19000, log_every=10, eval_every=250, checkpoint_every=1000),
    )


PRESETS = {"tiny": tiny, "speedrun": speedrun, "small": small, "gpt2-124m": gpt2_124m,
           "gpt2-350m": gpt2_350m}


def get_preset(name: str) -> TrainConfig:
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}{did_you_mean(name, PRESETS)}; choose one of "
                          f"{', '.join(PRESETS)}")
    return PRESETS[name]()

"""run.sample_every: a sample of the model during training, printed by rank 0 under the progress
bar, as `ddpgpt sample` would print it from the checkpoint of that step (its defaults:
temperature 0.8, top-k 50, the KV cache).

    ddpgpt train --data data/stdlib --preset tiny --run.sample-every 50 --run.sample-prompt "def "

A sample changes nothing of the training: it draws from its own generator (seeded by run.seed,
the same draws at every sample, so that samples differ by the weights alone), never from the
global RNG that dropout uses, and puts the model back in training mode; a resumed run stays
bitwise the same. Rank 0 alone samples, unless the sync mode shards the weights (fsdp2: every
forward all-gathers them, a collective): then every rank samples alike.
"""

from __future__ import annotations

import torch

from ddpgpt.config.schema import TrainConfig
from ddpgpt.data.tokenizer import load_tokenizer
from ddpgpt.distributed.group import DistEnv
from ddpgpt.sync.modes import MODES

TOKENS = 64           # per sample: a few lines of text, a fraction of a step's cost
TEMPERATURE, TOP_K = 0.8, 50  # `ddpgpt sample`'s defaults


class Sampler:
    """Built once per run when run.sample_every is set; `due(step)` says when, and
    `__call__(trainer, write)` samples from the trainer's weights as they are now."""

    def __init__(self, cfg: TrainConfig, env: DistEnv, dataset):
        self.every, self.prompt, self.seed = cfg.run.sample_every, cfg.run.sample_prompt, \
            cfg.run.seed
        self.tokenizer = load_tokenizer(dataset.path, dataset.tokenizer)
        self.here = env.is_main or MODES[cfg.run.sync].shards_params  # a collective forward

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    @torch.no_grad()
    def __call__(self, trainer, write) -> None:
        """Every rank calls it at the same step; `write` prints rank 0's line."""
        if not self.here:
            return
        tok, model, device = self.tokenizer, trainer.raw, trainer.env.device
        ids = tok.encode_batch([self.prompt])[0].tolist() if self.prompt else [tok.eot_id]
        context = torch.tensor([ids], dtype=torch.long, device=device)  # (1, T)
        gen = torch.Generator(device=device).manual_seed(self.seed)
        was_training = model.training
        model.eval()  # no dropout: the global RNG is the training's
        try:
            with trainer.autocast():
                out = model.generate(context, TOKENS, TEMPERATURE, TOP_K, generator=gen,
                                     vocab_size=tok.vocab_size)
        finally:
            model.train(was_training)
        text = tok.decode(out[0, 0 if self.prompt else 1:].tolist())  # as `ddpgpt sample`
        if trainer.env.is_main:
            write(f"step {trainer.step}: sample: {text}")

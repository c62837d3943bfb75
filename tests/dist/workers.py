"""Functions that tests run on every rank: `python -m tests.dist.workers NAME ARGS_JSON OUT_JSON`.

Each runs inside `dist.session(device="cpu")` with the environment the test set (RANK, ...);
rank 0 writes the function's result as JSON to OUT_JSON.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from ddpgpt import dist


def eval_loss(env, data: str, max_windows: int) -> float:
    """evaluate() of a seeded tiny model, with the val windows split across the ranks."""
    from ddpgpt.config import ModelConfig
    from ddpgpt.data.loader import EvalLoader
    from ddpgpt.data.shards import TokenDataset
    from ddpgpt.evaluate import evaluate
    from ddpgpt.model import GPT

    model = GPT(ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=32, vocab_size=320), seed=5)
    loader = EvalLoader(TokenDataset(data), seq_len=32, micro_batch=3, world_size=env.world_size,
                        rank=env.rank, max_windows=max_windows)
    return evaluate(model, loader, env)


def count_allreduces(env, data: str, run_dir: str, accum: int, steps: int) -> dict:
    """Runs train_step `steps` times with A = `accum`; returns the DDP buckets all-reduced in each
    step, by index (DDP re-buckets after its first iteration, so the count can change once)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from ddpgpt.config_io import build
    from ddpgpt.preflight import preflight
    from ddpgpt.reliability import Guard, StopSignal
    from ddpgpt.train import Trainer

    overrides = {"model": {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 32},
                 "data": {"dir": data, "micro_batch": 2,
                          "global_batch": 2 * env.world_size * accum},
                 "run": {"dir": run_dir, "device": "cpu", "bucket_mb": 0.01}}
    cfg, dataset = preflight(build(None, None, overrides), env.world_size, env.local_world_size)
    t = Trainer(cfg, env, dataset, Guard(env, cfg.run, StopSignal()))
    t.wrap()
    calls = []

    def hook(state, bucket):
        calls.append(bucket.index())
        return default_hooks.allreduce_hook(None, bucket)

    t.ddp.register_comm_hook(None, hook)
    per_step = []
    for _ in range(steps):
        calls.clear()
        t.train_step()
        per_step.append(list(calls))
        grads = torch.cat([p.grad.flatten() for p in t.raw.parameters()])
        digests = dist.all_gather(env, torch.tensor(list(dist.digest(grads.numpy().tobytes())),
                                                    dtype=torch.uint8))
        assert all(torch.equal(d, digests[0]) for d in digests), \
            "ranks hold different gradients after the step"
        t.optimizer.zero_grad(set_to_none=True)
    t.unwrap()  # no DDP wrapper may outlive the process group
    return per_step


def main() -> None:
    name, args, out = sys.argv[1], json.loads(sys.argv[2]), Path(sys.argv[3])
    with dist.session(device="cpu") as env:
        result = globals()[name](env, **args)
        if env.is_main:
            out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()

"""Rank functions for the fine-tuning tests (tests/dist/test_chat.py; see workers.py)."""

from __future__ import annotations

from ddpgpt.distributed import collectives
from tests.dist.workers import main, make_trainer


def sft(env, data: str, run_dir: str, steps: int, variants: list[dict]) -> dict:
    """Trains `steps` steps of the tiny config (G = 8, T = 32) on `data` for each variant
    {"name", "mode", "b", "per_micro", "data", "init"} from the same init; returns each one's
    global losses (the mean over ranks of what train_step returns, as the health exchange logs
    it). `per_micro`: the per-micro-batch mean instead of ours (each micro-batch's mean over its
    own unmasked targets, / A, averaged over W by the sync: nanochat's SFT loss), by taking the
    plain path on masked targets. `init`: a base run to start from (--init-from: its shape, its
    weights, the vocabulary grown), as `train` reads it."""
    from ddpgpt.config.io import build
    from ddpgpt.guard.health import Guard, StopSignal
    from ddpgpt.optim.schedule import Schedule
    from ddpgpt.run.init_weights import Shape, read_state
    from ddpgpt.run.preflight import preflight
    from ddpgpt.trainer import Trainer

    out = {}
    for v in variants:
        flags = {"model": {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 32,
                           "init_from": v.get("init", "")},
                 "data": {"dir": v.get("data", data), "micro_batch": v["b"], "global_batch": 8},
                 "optim": {"lr": 1e-2, "warmup_steps": 2},
                 "run": {"dir": run_dir, "device": "cpu", "threads": 1, "sync": v["mode"],
                         "bucket_mb": 0.01}}
        if v.get("init"):
            cfg, dataset = preflight(build(None, None, flags, shape=Shape()), env.world_size,
                                     env.local_world_size)
            t = Trainer(cfg, env, dataset, Guard(env, cfg.run, StopSignal(announce=False)),
                        init=read_state(v["init"], cfg.model, dataset.vocab_size))
        else:
            t = make_trainer(env, flags)
        if v.get("per_micro"):
            t._batches = lambda t=t: (t.loader.next_step(), None)
        losses = []
        for k in range(steps):
            loss, _ = t.train_step()
            summed = collectives.all_reduce(env, loss.detach().clone())
            losses.append((summed / env.world_size).item())
            t.update(Schedule(t.cfg.optim, steps).at(k))
            t.step += 1
        out[v["name"]] = {"losses": losses, "masked": t.loader.masked,
                          "align": t.cfg.data.align}
        t.close()
    return out


if __name__ == "__main__":
    main(globals())

"""`ddpgpt sample`: generate text from a run's latest checkpoint, with the run's tokenizer.

    ddpgpt sample --run-dir runs/demo --prompt "def " --max-new-tokens 200 --temperature 0.8 \\
        --top-k 50
"""

from __future__ import annotations

import json

import torch

from ddpgpt import checkpoint, dist
from ddpgpt.config import SampleConfig
from ddpgpt.config_io import from_dict
from ddpgpt.data.tokenizer import load_tokenizer
from ddpgpt.evaluate import latest_checkpoint
from ddpgpt.model import GPT
from ddpgpt.run_dir import RunDir
from ddpgpt.runtime import autocast, inference_precision


def run(cfg: SampleConfig) -> None:
    run_dir = RunDir(cfg.run_dir)
    path, meta, state = latest_checkpoint(run_dir)
    train_cfg = from_dict(meta["config"], source=str(path / "meta.json"))
    tok = load_tokenizer(run_dir.path, json.loads(run_dir.data_meta.read_text())["tokenizer"])
    device = dist.resolve_device(cfg.device, 0)
    model = GPT(train_cfg.model).to(device)
    checkpoint.load_weights(path, model, state["model"])
    model.eval()
    ids = tok.encode_batch([cfg.prompt])[0].tolist() if cfg.prompt else [tok.eot_id]
    context = torch.tensor([ids] * cfg.num_samples, dtype=torch.long, device=device)
    gen = torch.Generator(device=device).manual_seed(cfg.seed)
    with autocast(inference_precision(train_cfg.run, device), device)():
        out = model.generate(context, cfg.max_new_tokens, cfg.temperature, cfg.top_k or None,
                             generator=gen, vocab_size=tok.vocab_size, use_cache=cfg.cache)
    for i, row in enumerate(out.tolist()):
        text = tok.decode(row[0 if cfg.prompt else 1:])
        if cfg.num_samples > 1:
            print(f"--- sample {i + 1} (step {meta['step']}) ---")
        print(text)

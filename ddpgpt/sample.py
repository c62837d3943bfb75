"""`ddpgpt sample`: generate text from a run's latest checkpoint, with the run's tokenizer.

    ddpgpt sample --run runs/demo --prompt "def " --max-new-tokens 200 --temperature 0.8 --top-k 50
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ddpgpt import checkpoint, dist
from ddpgpt.config import SampleConfig
from ddpgpt.data.tokenizer import load_tokenizer
from ddpgpt.model import autocast_for, build_model


def run(cfg: SampleConfig) -> None:
    path, meta, train_cfg = checkpoint.latest_for_inference(cfg.run)
    data_meta = json.loads((Path(cfg.run) / "data_meta.json").read_text())
    tok = load_tokenizer(cfg.run, data_meta["tokenizer"])
    device = dist.resolve_device(cfg.device, 0)
    model = build_model(train_cfg, device)
    checkpoint.load_weights(path, model)
    model.eval()
    ids = tok.encode_batch([cfg.prompt])[0].tolist() if cfg.prompt else [tok.eot_id]
    context = torch.tensor([ids] * cfg.num_samples, dtype=torch.long, device=device)
    gen = torch.Generator(device=device).manual_seed(cfg.seed)
    with autocast_for(train_cfg, device)():
        out = model.generate(context, cfg.max_new_tokens, cfg.temperature, cfg.top_k or None, generator=gen)
    for i, row in enumerate(out.tolist()):
        text = tok.decode(row[0 if cfg.prompt else 1:])
        if cfg.num_samples > 1:
            print(f"--- sample {i + 1} (step {meta['step']}) ---")
        print(text)

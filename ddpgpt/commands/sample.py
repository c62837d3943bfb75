"""`ddpgpt sample`: generate text from a run's latest checkpoint, with the run's tokenizer.

    ddpgpt sample --run-dir runs/demo --prompt "def " --max-new-tokens 200 --temperature 0.8 \\
        --top-k 50
"""

from __future__ import annotations

import torch

from ddpgpt.checkpoint.read import load_model
from ddpgpt.config.commands import SampleConfig
from ddpgpt.data.tokenizer import load_tokenizer
from ddpgpt.distributed.group import resolve_device
from ddpgpt.run.precision import Precision, flush_denormals, sampling_threads
from ddpgpt.run.run_dir import RunDir


def run(cfg: SampleConfig) -> None:
    run_dir = RunDir(cfg.run_dir)
    device = resolve_device(cfg.device, 0)
    model, found = load_model(run_dir, device)  # first: a run without a checkpoint says so
    tok = load_tokenizer(run_dir.path, run_dir.read_data_meta("sample needs")["tokenizer"])
    train_cfg, meta = found.config, found.meta
    if device.type == "cpu":
        flush_denormals()
    torch.set_num_threads(cfg.threads or sampling_threads(model.num_params(False) *
                                                          cfg.num_samples))
    ids = tok.encode_batch([cfg.prompt])[0].tolist() if cfg.prompt else [tok.eot_id]
    context = torch.tensor([ids] * cfg.num_samples, dtype=torch.long, device=device)
    gen = torch.Generator(device=device).manual_seed(cfg.seed)
    with Precision.for_inference(train_cfg.run, device).autocast():
        out = model.generate(context, cfg.max_new_tokens, cfg.temperature, cfg.top_k or None,
                             generator=gen, vocab_size=tok.vocab_size, use_cache=cfg.cache)
    for i, row in enumerate(out.tolist()):
        text = tok.decode(row[0 if cfg.prompt else 1:])
        if cfg.num_samples > 1:
            print(f"--- sample {i + 1} (step {meta['step']}) ---")
        print(text)

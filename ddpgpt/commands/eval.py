"""Validation loss: token-weighted over the loader's fixed windows, all-reduced across ranks, and
the same as bits per byte of text (comparable across tokenizers; see TokenDataset.bits_per_byte);
with --task, each task scored by its kind (evals/kinds.py): multiple-choice accuracy as llm.c
scores HellaSwag, by default; CORE as nanochat scores it (--task core). With --init-from, a
transformers model's tasks instead of a run's (hf/pretrained.py).

    ddpgpt eval --run-dir runs/demo                                  # one process
    ddpgpt eval --run-dir runs/demo --step 200                       # that checkpoint's
    ddpgpt eval --run-dir runs/demo --task hellaswag --limit 1000 --json
    ddpgpt eval --run-dir runs/demo --task piqa --task-data piqa.jsonl
    ddpgpt eval --run-dir runs/demo --task core --task-data eval_bundle
    ddpgpt eval --init-from hf/gpt2 --task core --task-data eval_bundle
    torchrun --standalone --nproc_per_node 8 -m ddpgpt eval --run-dir runs/demo --task hellaswag
"""

from __future__ import annotations

import dataclasses
import json

import torch

from ddpgpt.checkpoint.read import check_data, model_of, run_checkpoint
from ddpgpt.config.commands import EvalConfig
from ddpgpt.config.schema import RunConfig
from ddpgpt.data.mixture import MixedDataset, open_data
from ddpgpt.data.shards import TokenDataset
from ddpgpt.data.tokenizer import load_tokenizer
from ddpgpt.distributed.group import session
from ddpgpt.errors import warn
from ddpgpt.evals.kinds import KINDS
from ddpgpt.evals.loss import eval_sets, evaluate_sets, val_text
from ddpgpt.evals.scorer import Scorer
from ddpgpt.evals.tasks import load_all
from ddpgpt.hf import pretrained
from ddpgpt.run.precision import Precision, flush_denormals
from ddpgpt.run.run_dir import RunDir


def run(cfg: EvalConfig) -> None:
    if cfg.init_from:
        return run_pretrained(cfg)
    run_dir = RunDir(cfg.run_dir)
    found = run_checkpoint(run_dir, cfg.step)
    train_cfg = found.config
    # The run's data, which must still be what it trained on; or --data, other data on purpose.
    data = dataclasses.replace(train_cfg.data, dir=cfg.data) if cfg.data else train_cfg.data
    dataset = open_data(data.sources())
    check_data(found, dataset, data.dir, given=bool(cfg.data), run=str(run_dir))
    # Bad task files and the download fail here, on every rank, before the group exists.
    tasks = load_all(cfg.task, cfg.task_data, cfg.limit, "--task", "--task-data")
    tokenizer = run_tokenizer(run_dir) if tasks else None
    with session(cfg.device, "auto") as env:
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        model = model_of(found, env.device)
        if env.device.type == "cpu":
            flush_denormals()  # as in training: the same figures, at full speed
        windows = train_cfg.data.eval_windows if cfg.windows < 0 else cfg.windows
        # a mixture: each source's val split, and their share-weighted sum (evals/loss.py)
        sets = eval_sets(dataset, seq_len=train_cfg.seq_len,
                         micro_batch=train_cfg.data.micro_batch, world_size=env.world_size,
                         rank=env.rank, eval_windows=windows, train_windows=0,
                         seed=train_cfg.data.seed, device=env.device,
                         align=train_cfg.data.align)
        precision = Precision.for_inference(train_cfg.run, env.device)
        row = evaluate_sets(model, sets, env, precision.autocast, progress=True)
        scores = {}
        if tasks:
            scorer = Scorer(tasks, tokenizer, train_cfg.model.block_size, env)
            scores = scorer.score(model, precision.autocast, progress=True)
        if env.is_main:
            report(cfg, dataset, row, scores, tasks, found.step,
                   sum(len(s.val.windows) for s in sets), train_cfg.seq_len, env.world_size)


def run_pretrained(cfg: EvalConfig) -> None:
    """The tasks of a transformers model (--init-from): no run, no dataset, no val loss."""
    tasks = load_all(cfg.task, cfg.task_data, cfg.limit, "--task", "--task-data")
    found = pretrained.load(cfg.init_from)
    with session(cfg.device, "auto") as env:
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        model = pretrained.model_of(found, env.device)
        if env.device.type == "cpu":
            flush_denormals()
        precision = Precision.for_inference(RunConfig(), env.device)
        scorer = Scorer(tasks, found.tokenizer, found.model.block_size, env)
        scores = scorer.score(model, precision.autocast, progress=True)
        if env.is_main:
            if cfg.json:
                print(json.dumps({"init_from": cfg.init_from, **_shown(scores)}))
                return
            m = found.model
            print(f"{cfg.init_from}: {found.kind}, {m.n_layer} layers × {m.n_embd}, "
                  f"{m.block_size} positions, {m.vocab_limit or m.vocab_size:,} ids "
                  f"({env.world_size} process{'es' if env.world_size > 1 else ''})")
            print_tasks(tasks, scores)


def report(cfg: EvalConfig, dataset: TokenDataset | MixedDataset, row: dict, scores: dict,
           tasks: list, step: int, windows: int, seq_len: int, world_size: int) -> None:
    """One line per result, or with --json one object. `row`: evaluate_sets' (val_loss,
    val_bpb; a mixture's each source's too)."""
    bpb, masked = row["val_bpb"], dataset.masked
    if bpb is None and not masked:  # conversations' loss is the assistant's tokens': no bpb
        warn(dataset.bytes_advice())
    if cfg.json:
        print(json.dumps({"step": step, **row, **_shown(scores)}))
        return
    bits = "" if bpb is None else f", val_bpb {bpb:.4f}"
    on = f", on {cfg.data}" if cfg.data else ""  # other data than the run's, on purpose
    over = "the assistant's tokens of " if masked else ""
    print(f"{val_text(row)}{bits} (step {step}, {over}{windows} windows of {seq_len} tokens, "
          f"{world_size} process{'es' if world_size > 1 else ''}{on})")
    print_tasks(tasks, scores)


def _shown(scores: dict) -> dict:
    """The scores --json prints: all but the seconds each task took."""
    return {k: v for k, v in scores.items() if not k.endswith("_s")}


def print_tasks(tasks: list, scores: dict) -> None:
    """A line per task: its kind's metrics; under a bundle's, a line per task of the bundle."""
    for task in tasks:
        name, kind = task.name, KINDS[task.kind]
        figures = ", ".join(f"{metric} {scores[f'{name}_{metric}']:.4f}"
                            for metric in kind.metrics)
        print(f"{name}: {figures} ({scores[name + '_n']:,} examples of {task.source}, "
              f"{scores[name + '_s']:.1f} s)")
        for part in task.examples if kind.parts else ():
            key = f"{name}_{part.label}"
            figures = ", ".join(f"{metric} {scores[f'{key}_{metric}']:.4f}"
                                for metric in kind.parts)
            print(f"  {part.label}: {figures} ({scores[key + '_n']:,} examples, "
                  f"{part.shots}-shot {part.type})")


def run_tokenizer(run_dir: RunDir):
    """The tokenizer a run was trained with (the run dir keeps its data's meta and files)."""
    return load_tokenizer(run_dir.path, run_dir.read_data_meta("tasks need")["tokenizer"])

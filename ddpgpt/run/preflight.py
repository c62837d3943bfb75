"""What a training run checks and resolves before any process group exists, so bad input fails
at once, with one line, before anything is written:

    cfg, dataset = preflight(cfg, world_size=2, local_world_size=2)

Every `auto` is resolved here, once: the device kind, the backend, the precision, the sequence
length, the vocabulary size, where rows start (data.align), the attention of masks
(model.attention), the CPU threads and whether to evaluate before the first step. Resolving a
resolved config changes nothing, so the `--nproc` launcher resolves it, writes it as the run's
config.json, and its workers start from that file.
The accumulation A = G / (W·b) is derived here too, the one place that checks it.
"""

from __future__ import annotations

import dataclasses
import math
import os

import torch

from ddpgpt.checkpoint import location
from ddpgpt.config.checks import ConfigError
from ddpgpt.config.schema import TrainConfig, padded_vocab
from ddpgpt.data import storage
from ddpgpt.data.loader import require_windows, row_source
from ddpgpt.data.mixture import MixedDataset, open_data
from ddpgpt.data.shards import TokenDataset
from ddpgpt.distributed.group import default_backend
from ddpgpt.model import flex
from ddpgpt.run import trackers
from ddpgpt.sync.modes import MODES, check


def accum_steps(cfg: TrainConfig, world_size: int) -> int:
    """A = G / (W·b), or a ConfigError naming all four numbers."""
    G, b, W = cfg.data.global_batch, cfg.data.micro_batch, world_size
    if G % (W * b):
        # W processes cannot share G sequences evenly: no micro-batch helps, other W do
        fix = "or change the micro-batch" if G % W == 0 else (
            f"or run on a number of processes that divides {G} "
            f"({', '.join(str(w) for w in range(1, G + 1) if G % w == 0 and w <= 64)})")
        raise ConfigError(f"data.global_batch = {G} is not divisible by world size {W} × "
                          f"data.micro_batch {b} = {W * b}; make the global batch a multiple of "
                          f"{W * b} {fix}")
    return G // (W * b)


def check_world_sizes(cfg: TrainConfig, nodes: tuple[int, int], per_node: int) -> None:
    """An elastic job (`torchrun --nnodes MIN:MAX`) may restart at any W = n × per_node for n in
    MIN..MAX; the global batch must split for each, or the job is refused now, in one line.

    Refused rather than adapted: b is the memory knob, chosen for the device. Adapting it per W
    (the largest divisor of G / W not above b) would keep the batches' composition, but change
    the memory per device and the kernels' shapes at every restart, and make a W that does not
    divide G fail only when a restart reaches it."""
    G, b = cfg.data.global_batch, cfg.data.micro_batch
    sizes = [n * per_node for n in range(nodes[0], nodes[1] + 1)]
    bad = [W for W in sizes if G % (W * b)]
    if not bad:
        return
    need = math.lcm(*(W * b for W in sizes))
    per = f"{per_node} process{'es' if per_node > 1 else ''} per node"
    raise ConfigError(f"torchrun --nnodes {nodes[0]}:{nodes[1]} ({per}) lets the job restart at "
                      f"world size {', '.join(map(str, sizes))}, but data.global_batch = {G} "
                      f"is not divisible by W × data.micro_batch for W = "
                      f"{', '.join(map(str, bad))}; make the global batch a multiple of {need}, "
                      "or change the micro-batch or the --nnodes range")


def resolve(cfg: TrainConfig, dataset: TokenDataset, local_world_size: int) -> TrainConfig:
    """`cfg` with no `auto` left: what config.json records and every process runs with."""
    vocab = cfg.model.vocab_size or padded_vocab(dataset.vocab_size)
    if vocab < dataset.vocab_size:
        raise ConfigError(f"dataset {dataset.path} has a vocabulary of {dataset.vocab_size} but "
                          f"model.vocab_size = {vocab}; set model.vocab_size >= "
                          f"{dataset.vocab_size} (or 0 to follow the dataset)")
    device = cfg.run.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    precision = cfg.run.precision
    if precision == "auto":
        precision = "bf16" if device == "cuda" else "fp32"
    check_mode(cfg, precision)
    threads = cfg.run.threads or max(1, len(os.sched_getaffinity(0)) // local_world_size)
    first = bool(cfg.model.init_from) if cfg.run.eval_at_start is None else cfg.run.eval_at_start
    run = dataclasses.replace(cfg.run, device=device, precision=precision, threads=threads,
                              eval_at_start=first,
                              backend=(default_backend(device) if cfg.run.backend == "auto"
                                       else cfg.run.backend))
    ns_dtype = cfg.optim.muon_ns_dtype
    if ns_dtype == "auto":
        ns_dtype = "fp32" if precision == "fp32" else "bf16"
    align = cfg.data.align  # auto: conversations are packed whole (data/packing.py)
    if align == "auto":
        align = "bos" if dataset.masked else "stream"
    doc_mask = align == "bos" if cfg.model.doc_mask is None else cfg.model.doc_mask
    attention = flex.choose(cfg.model.attention, device, cfg.model.dropout, cfg.seq_len,
                            doc_mask)
    if attention == "flex" and flex.refusal(device, cfg.model.dropout):
        raise ConfigError(flex.refusal(device, cfg.model.dropout))
    model = dataclasses.replace(cfg.model.resolved(), vocab_size=vocab,  # the arch's pieces set
                                doc_mask=doc_mask, attention=attention,
                                bos_id=dataset.eot_id if cfg.model.bos_id < 0 else cfg.model.bos_id)
    return dataclasses.replace(cfg, model=model,
                               data=dataclasses.replace(cfg.data, seq_len=cfg.seq_len,
                                                        align=align), run=run,
                               optim=dataclasses.replace(cfg.optim, muon_ns_dtype=ns_dtype))


def check_mode(cfg: TrainConfig, precision: str) -> None:
    """What the sync mode declares it cannot do (sync.MODES), refused in one line each."""
    name = cfg.run.sync
    mode = check(name)

    def refuse(what: str, setting: str, fix: str) -> None:
        able = [m for m, row in MODES.items() if getattr(row, what)]
        raise ConfigError(f"run.sync = {name} cannot use {setting}: {mode.why_not[what]}; "
                          f"{fix}, or run.sync {', '.join(able)}")

    if precision == "fp16" and not mode.loss_scaler:
        refuse("loss_scaler", "run.precision = fp16", "use bf16")
    if cfg.run.grad_compress != "none" and not mode.compression:
        refuse("compression", f"run.grad_compress = {cfg.run.grad_compress}", "use none")


def check_windows(cfg: TrainConfig, dataset: TokenDataset | MixedDataset) -> None:
    """Enough windows for one global batch (train) and one evaluation (val); a mixture's
    sources, one window each of both (each goes round its epochs as often as it must)."""
    align = cfg.data.align
    if isinstance(dataset, MixedDataset):
        for ds in dataset.datasets:
            require_windows(row_source(ds, "train", cfg.seq_len, align), 1)
            require_windows(row_source(ds, "val", cfg.seq_len, align), 1)
        return
    require_windows(row_source(dataset, "train", cfg.seq_len, align), cfg.data.global_batch,
                    "one global batch of ")
    require_windows(row_source(dataset, "val", cfg.seq_len, align), 1)


def preflight(cfg: TrainConfig, world_size: int, local_world_size: int,
              nodes: tuple[int, int] | None = None
              ) -> tuple[TrainConfig, TokenDataset | MixedDataset]:
    """Batch arithmetic (for every W of an elastic job's `nodes` range too), the dataset and its
    fit to the model and the batch; the resolved config."""
    accum_steps(cfg, world_size)
    if nodes is not None and nodes[1] > nodes[0]:
        check_world_sizes(cfg, nodes, local_world_size)
    trackers.check(cfg.run.tracker)
    storage.check_cache(cfg.data.cache)
    if cfg.run.checkpoint_url:  # a bucket that is not there or not ours: one line, now
        location.check_writable(cfg.run.checkpoint_url)
    dataset = open_data(cfg.data.sources())
    if cfg.model.init_from:  # a hub name is downloaded here, once, before any worker
        from ddpgpt.run.init_weights import check_tokenizer, grow_vocab

        check_tokenizer(cfg, dataset)
        cfg = grow_vocab(cfg, dataset)  # the chat template's tokens: the vocabulary grows
    cfg = resolve(cfg, dataset, local_world_size)
    check_windows(cfg, dataset)
    return cfg, dataset


def shared(cfg: TrainConfig) -> dict:
    """The config every rank must agree on: all of it but what is each node's own: the CPU
    thread count, the data cache, and, when checkpoints go to a URL, the local run dir."""
    values = cfg.to_dict()
    del values["run"]["threads"], values["data"]["cache"]
    if cfg.run.checkpoint_url:
        del values["run"]["dir"]
    return values


def print_config(cfg: TrainConfig, nproc: int | None) -> None:
    """`train --print-config`: what `train` would run with, as TOML. Every `auto` is resolved as
    the run would resolve it; without the dataset (not prepared yet), the values that depend on
    it stay as given, and a comment says so; a dataset that is there but will not do is its one
    line. What belongs to one start (config.io.START_FIELDS: the threads, --reset) is printed
    at its default, with this start's value in a comment: the file, given to --config, would
    otherwise pin it for every start, on every machine."""
    from ddpgpt.config.io import START_FIELDS, to_toml
    from ddpgpt.distributed.group import detect
    from ddpgpt.errors import DataError
    from ddpgpt.run import resume
    from ddpgpt.run.run_dir import RunDir

    here = detect()
    world = nproc or here.world_size
    try:
        cfg, dataset = preflight(cfg, world, nproc or here.local_world_size)
    except DataError as e:
        # there (a directory, or objects under a URL's prefix), and wrong: an error, not a
        # config to print; a bucket that is not there, or not ours, is its own line
        if all(storage.open_dir(d).exists() for d, _ in cfg.data.sources()):
            raise
        print(f"# not resolved (model.vocab_size, data.seq_len, run.*: auto): {e}")
    else:
        cfg, start = resume.plan(cfg, RunDir(cfg.run.dir, cfg.run.checkpoint_url), dataset)
        where = f"resuming {start.path}" if start.path else "from scratch"
        print(f"# resolved for {world} process{'es' if world > 1 else ''}, {where}")
    fresh, own = TrainConfig(), {}
    for section, names in START_FIELDS.items():
        mine, theirs = getattr(cfg, section), getattr(fresh, section)
        own.update({(section, n): getattr(mine, n) for n in names
                    if getattr(mine, n) != getattr(theirs, n)})
        cfg = dataclasses.replace(cfg, **{section: dataclasses.replace(
            mine, **{n: getattr(theirs, n) for n in names})})
    lines, section = [], None
    for line in to_toml(cfg).splitlines():
        section = line[1:-1] if line.startswith("[") else section
        name = line.partition(" = ")[0]
        if (section, name) in own:
            line += f"  # this start's: {own[section, name]!r} (each start decides its own)"
        lines.append(line)
    print("\n".join(lines) + "\n", end="")

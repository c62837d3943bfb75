"""Typed configuration: one dataclass per concern, a docstring under every field, validation.

A training config is built in layers (`io.py`): a preset (`presets.py`), a TOML file,
then command-line flags. Every value is checked for its type and range before any process group
exists; a bad one is a `ConfigError`: one line naming the field, the source and the fix. Every
`auto` is then resolved once (`run/preflight.py`) and the result saved as the run's `config.json`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from ddpgpt.config import choices
from ddpgpt.config.checks import _choice, _finite, _number, _require, _shares
from ddpgpt.config.model import ModelConfig
from ddpgpt.config.optim import OptimConfig

MAX_BUCKET_MB = 65536     # 64 GiB: larger than any device's memory, far below an int overflow
MAX_TIMEOUT_S = 1_000_000  # ~11.6 days: longer waits overflow the backends' timeouts


def padded_vocab(vocab: int) -> int:
    """A dataset's vocabulary rounded up to a multiple of 64 for fast matmuls where that adds at
    most 1% (GPT-2's 50,257 ids -> 50,304 rows); a smaller one is kept as it is: 257 byte ids ->
    320 rows would add 25% to the output layer and cost 3% of a tiny-preset step on a CPU."""
    padded = -(-vocab // 64) * 64
    return padded if padded - vocab <= vocab // 100 else vocab


@dataclass
class DataConfig:
    """Where the tokens come from and how they are batched."""

    dir: str = field(default="data/stdlib", metadata={"alias": "--data"})
    """Dataset directory made by `ddpgpt prepare`."""
    # Or its URL in object storage (s3://BUCKET/PREFIX, the cloud extra: each rank reads its
    # windows with ranged reads, data/storage.py); or a mixture of several, DIR:WEIGHT,...
    # (sources(); the train command's examples show one, docs/usage.md says the rest).
    seq_len: int = 0
    """Training sequence length T in tokens; 0 uses model.block_size."""
    micro_batch: int = 8
    """Sequences per process per micro-step (b): bounded by device memory."""
    global_batch: int = 32
    """Sequences per optimizer step (G), fixed whatever the number of processes W; the
    accumulation steps are G / (W * b)."""
    seed: int = 1337
    """Seed of the data order (the per-epoch permutation of windows)."""
    shuffle: bool = True
    """Visit windows in a seeded random order each epoch (else in file order)."""
    align: choices.Align = "auto"
    """Where a training or validation row of seq_len + 1 tokens starts. stream: anywhere in the
    concatenated documents (windows seq_len apart). bos: at a document start; documents packed
    best-fit into rows (conversations whole: docs/chat.md), not cropped (data/packing.py; cached
    beside the shards); model.doc_mask on unless set. auto: bos for conversations, else stream."""
    eval_windows: int = 256
    """Validation windows per evaluation, evenly spaced over the val split; 0 uses all."""
    train_eval_windows: int = -1
    """Training windows scored at each evaluation beside the val loss (train_eval_loss: the fit
    of the data trained on, to tell overfitting from a data problem), a fixed sample drawn by
    data.seed at any W and resume. -1: as many as the val loss scores (data.eval_windows; the val
    split's count when that is 0); 0: off."""
    verify: bool = True
    """Re-hash every shard against meta.json at startup (the ranks share the work); off: faster."""
    cache: str = ""
    """A local directory (per node) that keeps what is read of a dataset in object storage,
    in blocks of 1 MiB: later epochs and restarts read it from the disk. Empty: none (each
    window is fetched when it is needed, ahead of the step that reads it)."""
    allow_switch: bool = False
    """Resume a checkpoint on another dataset than it was trained on (its fingerprint differs):
    the loader starts the new data from its beginning, metrics.jsonl records the switch; without
    it such a resume is refused. Only its own start (and restarts) has it, as with --reset."""

    def __post_init__(self):
        for name in ("micro_batch", "global_batch"):
            _require(getattr(self, name) >= 1, f"data.{name} = {getattr(self, name)} must be >= 1")
        _require(self.seq_len >= 0,
                 f"data.seq_len = {self.seq_len} must be >= 0 (0: model.block_size)")
        _require(self.eval_windows >= 0, f"data.eval_windows = {self.eval_windows} must be >= 0")
        self.sources()  # a mixture's syntax and weights
        _require(self.train_eval_windows >= -1, f"data.train_eval_windows = "
                 f"{self.train_eval_windows} must be >= -1 (-1: as many as val, 0: off)")
        _choice("data", "align", self.align, choices.Align)

    def sources(self) -> list[tuple[str, float]]:
        """data.dir as [(directory, share)]: one dataset at share 1, or a mixture's, the shares
        normalized to sum to 1 in the order given."""
        parts = self.dir.split(",")
        if len(parts) == 1:  # one dataset; DIR:WEIGHT of a mixture of one is DIR
            path, _, weight = self.dir.rpartition(":")
            return [(path if path and _number(weight) else self.dir, 1.0)]
        out = []
        for part in parts:
            path, _, weight = part.rpartition(":") if _weighted(part) else (part, "", "")
            _require(bool(path.strip()), f"data.dir = {self.dir!r}: an empty dataset name in "
                     "the mixture; write DIR:WEIGHT,DIR:WEIGHT (a:0.7,b:0.3)")
            try:
                share = float(weight) if weight else None
            except ValueError:
                share = -1.0
            _require(share is None or (math.isfinite(share) and share > 0),
                     f"data.dir = {self.dir!r}: the weight of {path} must be a number > 0, got "
                     f"{weight!r}; write DIR:WEIGHT,DIR:WEIGHT (a:0.7,b:0.3)")
            out.append((path.strip(), share))
        weighted = [share is not None for _, share in out]
        _require(all(weighted) or not any(weighted), f"data.dir = {self.dir!r}: give every "
                 "dataset of the mixture a weight (a:0.7,b:0.3), or none for equal shares")
        dirs = [path for path, _ in out]
        twice = next((d for d in dirs if dirs.count(d) > 1), None)
        _require(twice is None, f"data.dir = {self.dir!r}: {twice} is listed twice; give each "
                 "dataset once, with its whole weight")
        return _shares(self.dir, out)


def _weighted(part: str) -> bool:
    """A mixture's DIR:WEIGHT has a weight: a ':' after the last '/' (s3://b/x is a URL)."""
    return ":" in part.rsplit("/", 1)[-1]


@dataclass
class RunConfig:
    """The run: length, logging, checkpoints, devices and precision."""

    dir: str = field(default="runs/default", metadata={"alias": "--run-dir"})
    """Run directory: config.json, metrics.jsonl, checkpoints/."""
    steps: int = 200
    """Optimizer steps to train for in total (a resumed run continues up to this)."""
    seed: int = 1337
    """Seed of the model init, identical on every rank."""
    log_every: int = 1
    """Write a metrics.jsonl row every this many steps."""
    eval_every: int = 100
    """Evaluate on the validation windows every this many steps (and at the end); 0: end only."""
    eval_at_start: bool | None = None
    """Evaluate before the first step too (step 0). Unset: on with model.init_from, else off."""
    sample_every: int = 0
    """Print a 64-token sample every this many steps (as `ddpgpt sample`; its own RNG); 0: off."""
    sample_prompt: str = ""
    """The text the samples continue; empty: a fresh document."""
    eval_tasks: str = ""
    """Multiple-choice tasks scored at every evaluation, comma-separated: hellaswag (downloaded
    once) or NAME with eval_task_data (KIND:NAME: another kind of task; core: CORE's bundle).
    metrics.jsonl's eval rows get NAME_acc_norm, NAME_acc, NAME_acc_char, NAME_n and NAME_s (the
    seconds it took); core's core_metric and each task's core_LABEL_acc and _centered. The same
    at any number of processes."""
    eval_task_data: str = ""
    """The eval_tasks' jsonl files (ctx, endings, label per line), comma-separated in their order;
    empty for hellaswag's download; core's: the eval bundle's directory."""
    eval_task_limit: int = 0
    """Score the first this many examples of each task at each evaluation; 0: all."""
    eval_core_limit: int = 500
    """Examples of each of a CORE bundle's tasks scored at each evaluation (nanochat's 500 in
    training): shuffled with nanochat's seed, then the first this many; 0: all."""
    target_val_loss: float = 0.0
    """Stop at the first evaluation whose val loss is at most this (time to target): a
    checkpoint, a metrics.jsonl row {"event": "target", "val_loss", "elapsed_s", "train_s",
    "tokens"} and one line. 0: off."""
    checkpoint_every: int = 100
    """Save a checkpoint every this many steps (and at the end); 0: end only."""
    checkpoint_url: str = field(default="", metadata={"alias": "--checkpoint-url"})
    """Write the checkpoints to this URL of object storage (s3://BUCKET/PREFIX; the cloud extra)
    instead of the run dir's checkpoints/ (which stays local, with the logs); on another machine,
    train --run-dir NEW --run.checkpoint-url URL goes on from its newest checkpoint."""
    lease_stale_s: float = 600.0
    """Seconds after which another job's lease of checkpoint_url (renewed every lease_stale_s / 4
    and at each checkpoint) is taken over, its job taken as dead."""
    take_over: bool = False
    """Take over another job's lease of checkpoint_url: that job is dead (this start only)."""
    keep_checkpoints: int = 3
    """Keep the newest this many checkpoints, deleting older ones."""
    checkpoint_async: bool = True
    """Write checkpoints in the background: the step waits only while each rank copies its share
    of the state (about 1/W of it) to CPU memory, and the next save (or a stop, or the end) waits
    for the files; false: the step waits until the checkpoint is published, with no copy."""
    resume: str = field(default="auto", metadata={"alias": "--resume"})
    """How the job's first start begins (every restart continues from the run dir's newest
    complete checkpoint): auto, the newest complete checkpoint if any; never, refuse a run dir that
    has checkpoints; reset (or --reset), set its checkpoints and metrics aside into reset-<time>/
    and start over; or the path of a checkpoint directory (reruns continue from the run dir)."""
    device: choices.Device = field(default="auto", metadata={"alias": "--device"})
    """auto (cuda:LOCAL_RANK when CUDA is available, else cpu), cpu or cuda."""
    backend: choices.Backend = "auto"
    """Process-group backend: auto (nccl on CUDA, gloo on CPU), nccl or gloo."""
    precision: choices.Precision = "auto"
    """auto (bf16 autocast on CUDA, fp32 on CPU), fp32, bf16 or fp16 (autocast + GradScaler)."""
    compile: bool = field(default=False, metadata={"alias": "--compile"})
    """Apply torch.compile to the model."""
    sync: str = "ddp"
    """How gradients are synchronized: ddp (DistributedDataParallel), allreduce (our own flat
    buckets, one asynchronous all_reduce each, overlapping the backward), rs-ag (the same
    buckets, reduce-scatter then all-gather), zero1 (reduce-scatter; each rank steps its 1/W of
    the parameters and optimizer state; all-gather) or fsdp2 (torch's fully_shard: parameters,
    gradients and optimizer state sharded). The same training whatever the mode, with either
    optimizer (Muon by whole matrices, each on one rank)."""
    bucket_mb: float = 25.0
    """Gradient bucket size in MB (every sync mode)."""
    grad_compress: choices.GradCompress = "none"
    """none, or bf16: gradients travel between ranks in bfloat16 (half the bytes; the sum over
    ranks is rounded to bf16) and still accumulate over micro-steps in fp32."""
    threads: int = 0
    """torch CPU threads per process; 0 uses the machine's cores divided by the local processes
    (resolved per node: nodes may differ)."""
    dist_timeout_s: float = field(default=600.0, metadata={"alias": "--dist-timeout"})
    """Longest wait of any collective, in seconds: a stalled or lost rank ends the job with an error
    naming the step after this long instead of hanging (gloo's own default is 30 minutes)."""
    on_nonfinite: choices.OnNonfinite = field(default="spike", metadata={"alias": "--on-nonfinite"})
    """When any rank sees a non-finite loss or gradient norm: spike (a loss spike: run.on_spike
    decides, and with on_spike = none the run stops), stop (every rank, naming the step and the
    newest healthy checkpoint) or skip (no update for that step, counted)."""
    max_skipped: int = 10
    """Stop once this many steps have been skipped for a non-finite value in the run."""
    on_spike: choices.OnSpike = "recover"
    """When the global loss spikes (above spike_ratio × the median of the last spike_window
    healthy steps, or not finite): recover (find the cause with one forward over the last
    healthy batch: bad data is skipped; bad weights are trained through as with none, and rolled
    back to the newest healthy checkpoint at a lower lr if they do not heal within
    spike_patience steps; never stops for a finite spike), stop (every rank, naming the newest
    healthy checkpoint), or none (train on; a non-finite value stops). See docs/reliability.md."""
    spike_ratio: float = 2.0
    """A step's global loss above this multiple of the recent median is a spike."""
    spike_window: int = 10
    """Healthy steps whose median loss a step is compared with; spikes are looked for once there
    are this many (a rollback restores the checkpoint's)."""
    spike_patience: int = 10
    """Steps a spike caused by the weights may last while the model trains through it, before
    a rollback; and batches skipped in a row as bad data before the next is taken for a new
    domain and trained on (on_spike = recover)."""
    rollback_lr_factor: float = 0.5
    """Each rollback multiplies the learning rate of the rest of the run by this."""
    max_rollbacks: int = 3
    """Train on through a spike instead of rolling back once this many rollbacks have happened
    within the last rollback_window steps."""
    rollback_window: int = 100
    """Steps over which max_rollbacks counts."""
    tracker: choices.Tracker = "none"
    """Mirror metrics.jsonl to an experiment tracker, from rank 0: none, tensorboard (event files
    in RUN/tensorboard/) or wandb (Weights & Biases; WANDB_MODE=offline logs to RUN/wandb/).
    Needs the track extra. A resumed run continues the same tracker run."""
    tracker_project: str = "ddpgpt"
    """The W&B project the run is logged to (tracker = wandb)."""

    def __post_init__(self):
        _finite(self, "run.")
        _require(self.steps >= 1, f"run.steps = {self.steps} must be >= 1")
        _require(self.log_every >= 1, f"run.log_every = {self.log_every} must be >= 1")
        for name in ("eval_every", "checkpoint_every", "threads", "sample_every"):
            _require(getattr(self, name) >= 0, f"run.{name} = {getattr(self, name)} must be >= 0")
        _require(self.keep_checkpoints >= 1,
                 f"run.keep_checkpoints = {self.keep_checkpoints} must be >= 1")
        _require(0 < self.bucket_mb <= MAX_BUCKET_MB,
                 f"run.bucket_mb = {self.bucket_mb:g} must be in (0, {MAX_BUCKET_MB}] (MB per "
                 "gradient bucket)")
        _choice("run", "device", self.device, choices.Device)
        _choice("run", "backend", self.backend, choices.Backend)
        _choice("run", "grad_compress", self.grad_compress, choices.GradCompress)
        _choice("run", "precision", self.precision, choices.Precision)
        _choice("run", "on_nonfinite", self.on_nonfinite, choices.OnNonfinite)
        _choice("run", "on_spike", self.on_spike, choices.OnSpike)
        _require(self.spike_ratio > 1, f"run.spike_ratio = {self.spike_ratio:g} must be > 1")
        _require(0 < self.rollback_lr_factor <= 1,
                 f"run.rollback_lr_factor = {self.rollback_lr_factor:g} must be in (0, 1]")
        for name in ("spike_window", "spike_patience", "rollback_window"):
            _require(getattr(self, name) >= 1, f"run.{name} = {getattr(self, name)} must be >= 1")
        _require(self.max_rollbacks >= 0, f"run.max_rollbacks = {self.max_rollbacks} must be >= 0")
        _require(self.lease_stale_s > 0, f"run.lease_stale_s = {self.lease_stale_s:g} must be > 0")
        _choice("run", "tracker", self.tracker, choices.Tracker)
        _require(0 < self.dist_timeout_s <= MAX_TIMEOUT_S,
                 f"run.dist_timeout_s = {self.dist_timeout_s:g} must be in (0, {MAX_TIMEOUT_S}] "
                 "seconds")
        _require(self.eval_task_limit >= 0,
                 f"run.eval_task_limit = {self.eval_task_limit} must be >= 0 (0: all)")
        _require(self.eval_core_limit >= 0,
                 f"run.eval_core_limit = {self.eval_core_limit} must be >= 0 (0: all)")
        _require(self.target_val_loss >= 0,
                 f"run.target_val_loss = {self.target_val_loss:g} must be >= 0 (0: off)")
        _require(bool(self.eval_tasks) or not self.eval_task_data,
                 "run.eval_task_data needs run.eval_tasks (the tasks its files hold)")
        _require(self.max_skipped >= 0, f"run.max_skipped = {self.max_skipped} must be >= 0")


@dataclass
class TrainConfig:
    """Everything `ddpgpt train` needs; saved resolved as the run's config.json."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """The network's shape ([model] in TOML, --model.* flags)."""
    data: DataConfig = field(default_factory=DataConfig)
    """Dataset and batching ([data], --data.*)."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer and schedule ([optim], --optim.*)."""
    run: RunConfig = field(default_factory=RunConfig)
    """Length, logging, checkpoints, devices ([run], --run.*)."""

    def __post_init__(self):
        _require(self.data.seq_len <= self.model.block_size,
                 f"data.seq_len = {self.data.seq_len} exceeds model.block_size = "
                 f"{self.model.block_size}; set data.seq_len <= {self.model.block_size} "
                 "(0: model.block_size) or raise model.block_size")
        _require(self.data.global_batch % self.data.micro_batch == 0,
                 f"data.global_batch = {self.data.global_batch} is not a multiple of "
                 f"data.micro_batch = {self.data.micro_batch}")

    @property
    def seq_len(self) -> int:
        return self.data.seq_len or self.model.block_size

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


SECTIONS = {"model": ModelConfig, "data": DataConfig, "optim": OptimConfig, "run": RunConfig}

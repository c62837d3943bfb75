"""The settings of every command but `train` (config.py): prepare, sample, chat, plot, eval,
export, doctor, bench and rendezvous. Each is one dataclass whose fields become the command's flags
(cli.py), with a docstring under every field and one line for a bad value."""

from __future__ import annotations

from dataclasses import dataclass, field

from ddpgpt.config.checks import _choice, _finite, _require
from ddpgpt.config.choices import Device, Optimizer, Tokenizer
from ddpgpt.config.schema import MAX_BUCKET_MB

RUN_DIR = "runs/default"  # eval's --run-dir when not given


@dataclass
class PrepareConfig:
    """`ddpgpt prepare`: corpus sources -> tokenizer -> token shards."""

    sources: list[str] = field(default_factory=list)
    """Corpus sources: `stdlib` (default), files, directories, globs, or
    hf:NAME[:CONFIG][:SPLIT]. Files by extension: .parquet, .jsonl, .jsonl.gz, .jsonl.zst,
    .json.gz (one document per row), llm.c .bin shards (tokens), anything else as text."""
    out: str | None = None
    """Dataset directory to create (written to .NAME.partial beside it, renamed when complete;
    the same command continues an interrupted prepare)."""
    tokenizer: Tokenizer = "bpe"
    """bpe (trained on the corpus), byte (UTF-8 bytes), or gpt2 (tiktoken; needs the data extra)."""
    tokenizer_from: str | None = None
    """Use the tokenizer of this prepared dataset, run directory, or transformers directory
    (`ddpgpt export`'s, or GPT-2's: data for --init-from those weights); replaces --tokenizer."""
    text_field: str = "text"
    """The column (parquet, hf:) or field (jsonl) that holds each document's text."""
    skip_bad_rows: bool = False
    """Skip (and count) jsonl lines that are not JSON objects with a string text field, instead
    of stopping at the first."""
    chat: bool = False
    """Each record (a jsonl line, a parquet or hf: row) is a conversation: a list of {role,
    content} messages in its `messages` field (or --text-field), rendered by the chat template
    into tokens and a loss mask on the assistant's replies; the tokenizer gets the template's
    special tokens (docs/chat.md)."""
    strict: bool = False
    """With --chat: stop at the first record that is not a conversation (no assistant turn, an
    unknown role, empty content), instead of counting and skipping it."""
    workers: int = 0
    """Processes that read and encode; 0: every core this process may use. The output is
    the same for any number."""
    part: str | None = None
    """I/N: prepare only part I (1..N) of the corpus's units into --out, for N machines; then
    `prepare --merge PART_DIRS --out DIR` makes the dataset."""
    merge: bool = False
    """The sources are the part directories of a `--part I/N` prepare: assemble them into one
    dataset, identical to a prepare on one machine."""
    max_tokens: int = 0
    """Stop after this many tokens of the corpus's stream (train and val together): a fixed
    prefix of it. 0: all."""
    vocab_size: int = 4096
    """Vocabulary size of the bpe tokenizer, end-of-text included (at least 257)."""
    val_fraction: float = 0.01
    """Fraction of documents, whole and evenly spaced, held out for validation (0 < f < 1)."""
    shard_tokens: int = 100_000_000
    """Tokens per shard file at most."""
    bpe_train_mb: int = 256
    """The bpe tokenizer is trained on at most this many MB of the corpus (the first documents)."""
    force: bool = False
    """Replace a non-empty --out directory (the old one is removed only after the new one is
    complete)."""
    verify: str | None = None
    """Instead of preparing: re-check every shard of this dataset directory (header, size,
    sha256)."""

    def __post_init__(self):
        _finite(self, "--")
        _choice("prepare", "tokenizer", self.tokenizer, Tokenizer)
        _require(0 < self.val_fraction < 1,
                 f"--val-fraction {self.val_fraction} must be between 0 and 1")
        _require(self.shard_tokens >= 1, f"--shard-tokens {self.shard_tokens} must be >= 1")
        _require(self.bpe_train_mb >= 1, f"--bpe-train-mb {self.bpe_train_mb} must be >= 1")
        _require(self.workers >= 0, f"--workers {self.workers} must be >= 0 (0: every core)")
        _require(self.max_tokens >= 0, f"--max-tokens {self.max_tokens} must be >= 0 (0: all)")
        _require(bool(self.text_field), "--text-field must name a field")
        _require(self.chat or not self.strict, "--strict refuses records that are not "
                 "conversations: it goes with --chat")
        if self.part is not None:
            i, _, n = self.part.partition("/")
            _require(i.isdigit() and n.isdigit() and 1 <= int(i) <= int(n),
                     f"--part {self.part}: expected I/N with 1 <= I <= N, e.g. --part 3/8")
            _require(not self.merge, "--part and --merge contradict each other: prepare the "
                     "parts first, then merge them")

    @property
    def record_field(self) -> str:
        """The field each record's document or conversation is read from: --text-field, whose
        default for --chat is `messages`, the hub's chat sets' name."""
        return "messages" if self.chat and self.text_field == "text" else self.text_field

    @property
    def part_of(self) -> tuple[int, int] | None:
        """--part I/N as (I, N), or None."""
        if self.part is None:
            return None
        i, _, n = self.part.partition("/")
        return int(i), int(n)


@dataclass
class SampleConfig:
    """`ddpgpt sample`: generate text from a run's latest checkpoint."""

    run_dir: str = field(default="runs/default", metadata={"alias": "--run"})
    """Run directory, or the URL of its checkpoints (run.checkpoint_url); its latest complete
    checkpoint is used. Under torchrun write --run-dir: torchrun's own parser takes --run for an
    abbreviation of its --run-path."""
    prompt: str = ""
    """Text to continue; empty starts a fresh document (from the end-of-text token)."""
    max_new_tokens: int = 200
    """Tokens to generate."""
    temperature: float = 0.8
    """Softmax temperature; lower is more conservative; 0 is greedy (the most likely token each
    time, as --top-k 1)."""
    top_k: int = 50
    """Sample among the k most likely tokens; 0 samples from all."""
    num_samples: int = 1
    """Independent samples to print."""
    seed: int = 1337
    """Sampling seed."""
    device: Device = "auto"
    """auto (cuda when available), cpu or cuda."""
    threads: int = 0
    """CPU threads; 0: one for models whose sampling step is small (under ~200M parameters ×
    samples), where a second thread gains little and costs several times the step on a busy
    machine; else the usable cores."""
    cache: bool = True
    """Keep keys and values between tokens (a KV cache): each token costs the same whatever the
    length. --no-cache re-encodes the context for every token: the same tokens, slower."""

    def __post_init__(self):
        _finite(self, "--")
        _require(self.threads >= 0, f"--threads {self.threads} must be >= 0 (0: auto)")
        _require(self.max_new_tokens >= 1, f"--max-new-tokens {self.max_new_tokens} must be >= 1")
        _require(self.temperature >= 0, f"--temperature {self.temperature} must be >= 0 (0: "
                 "greedy)")
        _require(self.top_k >= 0, f"--top-k {self.top_k} must be >= 0 (0: off)")
        _require(self.num_samples >= 1, f"--num-samples {self.num_samples} must be >= 1")
        _choice("sample", "device", self.device, Device)


@dataclass
class ChatConfig:
    """`ddpgpt chat`: a conversation with a model fine-tuned on conversations (docs/chat.md). At
    a terminal: type a message, Enter; Ctrl-D ends. From a pipe: one user turn a line, one reply
    a turn."""

    run_dir: str = field(default=RUN_DIR, metadata={"alias": "--run"})
    """Run directory: its newest complete checkpoint answers (or --step's)."""
    step: int = 0
    """The checkpoint's step; 0: the newest complete one."""
    init_from: str = ""
    """Chat with this transformers directory (`ddpgpt export`'s, with its chat template) instead
    of a run's checkpoint."""
    system: str = ""
    """A system message that opens the conversation."""
    temperature: float = 0.7
    """Softmax temperature; 0 is greedy (the most likely token each time)."""
    top_k: int = 50
    """Sample among the k most likely tokens; 0 samples from all."""
    max_new_tokens: int = 256
    """Tokens a reply has at most (it ends earlier at <|assistant_end|>); the conversation keeps
    this much of the model's context free, its oldest turns dropped when it would not."""
    seed: int = 1337
    """Sampling seed."""
    device: Device = "auto"
    """auto (cuda when available), cpu or cuda."""
    threads: int = 0
    """CPU threads; 0: one for a small model (as sample's --threads), else the usable cores."""

    def __post_init__(self):
        _finite(self, "--")
        _require(self.max_new_tokens >= 1, f"--max-new-tokens {self.max_new_tokens} must be >= 1")
        _require(self.temperature >= 0, f"--temperature {self.temperature} must be >= 0 (0: "
                 "greedy)")
        _require(self.top_k >= 0, f"--top-k {self.top_k} must be >= 0 (0: off)")
        _require(self.threads >= 0, f"--threads {self.threads} must be >= 0 (0: auto)")
        _require(self.step >= 0, f"--step {self.step} must be >= 0 (0: the newest checkpoint)")
        _require(not self.init_from or (self.run_dir == RUN_DIR and not self.step),
                 f"--init-from {self.init_from} is the model to chat with: drop --run-dir and "
                 "--step")
        _choice("chat", "device", self.device, Device)


@dataclass
class PlotConfig:
    """`ddpgpt plot`: loss curves and throughput of one or more runs, in one picture."""

    runs: list[str] = field(default_factory=list)
    """Run directories (each with the metrics.jsonl `ddpgpt train` writes), or the URLs of runs'
    checkpoints (run.checkpoint_url), which hold a copy of it."""
    out: str | None = None
    """PNG to write; default: next to the first run (runs/NAME -> runs/NAME.png)."""
    smooth: float = -1.0
    """Exponential smoothing of the train loss: -1 (auto) averages over 1/20 of each run's
    logged rows (none for a 20-step run); 0 none; 0.9 about 10 rows."""

    def __post_init__(self):
        _finite(self, "--")
        _require(self.smooth == -1 or 0 <= self.smooth < 1,
                 f"--smooth {self.smooth} must be -1 (auto) or in [0, 1)")


@dataclass
class EvalConfig:
    """`ddpgpt eval`: validation loss of a run's latest checkpoint (or --step's) and, with
    --task, multiple-choice accuracy or CORE; or, with --init-from, the tasks of a transformers
    model (runs under torchrun too)."""

    run_dir: str = field(default=RUN_DIR, metadata={"alias": "--run"})
    """Run directory, or the URL of its checkpoints (run.checkpoint_url); its latest complete
    checkpoint is used, or --step's. Under torchrun write --run-dir: torchrun's own parser takes
    --run for an abbreviation of its --run-path."""
    step: int = 0
    """The checkpoint's step; 0: the newest complete one."""
    init_from: str = ""
    """Score this model instead of a run's: a transformers directory (GPT-2, Llama, Qwen3 or
    Apertus, as train's --init-from reads them, with the tokenizer saved beside it) or a hub
    name (gpt2, ...). Tasks only: there is no dataset for a validation loss."""
    data: str = ""
    """Evaluate on this dataset (DIR, or a mixture DIR:WEIGHT,...) instead of the run's own: other
    data on purpose, prepared with the run's tokenizer. Without it the run's data.dir must still
    hold the data the checkpoint was trained on (its fingerprint), or eval refuses."""
    windows: int = -1
    """Validation windows to evaluate; -1 uses the run's data.eval_windows, 0 all of them."""
    task: str = ""
    """Multiple-choice tasks to score besides the validation loss, comma-separated: hellaswag
    (its validation set, downloaded once into DDPGPT_CACHE_DIR or ~/.cache/ddpgpt), or any NAME
    given with --task-data (KIND:NAME: a task of another kind, evals/kinds.py). Each prints
    NAME_acc_norm (lowest mean loss per token, llm.c's), NAME_acc (lowest sum) and NAME_acc_char
    (sum per character, lm-evaluation-harness's). core: CORE's 22 tasks as nanochat scores them
    (core_metric, each task's core_LABEL_acc and core_LABEL_centered). chat:NAME: a task asked
    in the chat template, each ending as the assistant's reply (a fine-tuned model)."""
    task_data: str = ""
    """The tasks' jsonl files, comma-separated in --task's order: one example per line, {"ctx":
    ..., "endings": [...], "label": INDEX}. Empty for hellaswag: its cached download. core's: the
    eval bundle's directory (core.yaml, eval_meta_data.csv, eval_data/)."""
    limit: int = 0
    """Score the first this many examples of each task (core: of each of its tasks, after
    nanochat's shuffle); 0: all."""
    json: bool = False
    """Print one JSON object (val_loss, val_bpb, NAME_acc_norm, NAME_acc, NAME_acc_char, NAME_n)
    instead of lines."""
    device: Device = "auto"
    """auto (cuda:LOCAL_RANK when available), cpu or cuda."""
    threads: int = 0
    """torch CPU threads per process; 0: torch's own choice (every core; 1 under torchrun). On a
    busy machine fewer can be faster (docs/usage.md)."""

    def __post_init__(self):
        _require(self.threads >= 0, f"--threads {self.threads} must be >= 0 (0: torch's choice)")
        _require(self.windows >= -1, f"--windows {self.windows} must be >= -1")
        _require(self.limit >= 0, f"--limit {self.limit} must be >= 0 (0: all)")
        _require(self.step >= 0, f"--step {self.step} must be >= 0 (0: the newest checkpoint)")
        _require(not self.init_from or not self.step,
                 f"--step {self.step} picks a checkpoint of a run; --init-from {self.init_from} "
                 "has none (its weights are the model): drop --step")
        _require(bool(self.task) or not self.task_data,
                 "--task-data needs --task NAME (the task the file holds)")
        _require(not self.init_from or bool(self.task),
                 f"--init-from {self.init_from} scores tasks only (no dataset, no validation "
                 "loss): give --task (core, hellaswag, ...)")
        _require(not self.init_from or self.run_dir == RUN_DIR,
                 f"--init-from {self.init_from} and --run-dir {self.run_dir}: give one, the "
                 "model to score")
        _require(not self.init_from or self.windows == -1,
                 "--windows counts validation windows; --init-from has none (tasks only)")
        _require(not self.init_from or not self.data,
                 f"--data {self.data} is a run's validation data; --init-from scores tasks only")
        _choice("eval", "device", self.device, Device)


@dataclass
class RendezvousConfig:
    """`ddpgpt rendezvous`: host the c10d rendezvous store of elastic jobs on a node that does
    not train, so that losing any training node leaves the job able to go on."""

    host: str = "0.0.0.0"
    """Address to listen on (all interfaces by default)."""
    port: int = 29500
    """Port to listen on: the nodes' --rdzv-endpoint is THIS_HOST:PORT."""

    def __post_init__(self):
        _require(0 < self.port < 65536, f"--port {self.port} must be in 1..65535")


@dataclass
class ExportConfig:
    """`ddpgpt export`: a run's checkpoint as a Hugging Face transformers directory."""

    run_dir: str = field(default="runs/default", metadata={"alias": "--run"})
    """Run directory to export from, or the URL of its checkpoints (run.checkpoint_url)."""
    step: int = 0
    """The checkpoint's step; 0: the newest complete one."""
    out: str | None = None
    """Directory to write (config.json, model.safetensors, generation_config.json, the tokenizer);
    written beside it under a temporary name and renamed when complete."""
    force: bool = False
    """Replace a non-empty --out (the old one is removed only after the new one is in place)."""

    def __post_init__(self):
        _require(self.step >= 0, f"--step {self.step} must be >= 0 (0: the newest checkpoint)")


@dataclass
class DoctorConfig:
    """`ddpgpt doctor`: environment report and, with several processes, an all-reduce probe."""

    nproc: int = 0
    """Start this many local processes for the all-reduce probe (0: just this process, or
    torchrun's)."""
    probe_mb: float = 64.0
    """Size of the all-reduce probe tensor in MB."""

    def __post_init__(self):
        _finite(self, "--")
        _require(self.nproc >= 0, f"--nproc {self.nproc} must be >= 0")
        _require(0 < self.probe_mb <= MAX_BUCKET_MB,
                 f"--probe-mb {self.probe_mb:g} must be in (0, {MAX_BUCKET_MB}]")


@dataclass
class BenchConfig:
    """`ddpgpt bench`: what each gradient-sync mode costs on this machine or cluster."""

    data: str = "data/stdlib"
    """Dataset directory made by `ddpgpt prepare`."""
    preset: str = "tiny"
    """Named config to measure (tiny, speedrun, small, gpt2-124m, gpt2-350m)."""
    config: str | None = None
    """TOML file laid over the preset (as `train --config`), e.g. another model shape."""
    sync: str = ""
    """Comma-separated sync modes to measure (empty: every mode: ddp, allreduce, rs-ag, zero1,
    fsdp2)."""
    optim: str = ""
    """The optimizer every mode steps: adamw, or muon (Muon for the blocks' matrices); empty:
    the preset's or --config's."""
    steps: int = 10
    """Optimizer steps timed per mode and round (the median over all rounds is reported)."""
    warmup: int = 2
    """Optimizer steps run first and not timed."""
    repeats: int = 1
    """Rounds over the modes: the modes take turns, so a machine's drift reaches all of them."""
    group: bool = False
    """Join a process group even at world size 1, so each mode's own collectives run for real
    (one GPU: a one-rank NCCL group)."""
    nproc: int = 0
    """Start this many local processes (0: just this one, or torchrun's)."""
    out: str = "bench"
    """Directory for bench.json and bench.png."""
    device: Device = "auto"
    """auto (cuda:LOCAL_RANK when available), cpu or cuda."""

    def __post_init__(self):
        if self.optim:
            _choice("bench", "optim", self.optim, Optimizer)
        _require(self.steps >= 1, f"--steps {self.steps} must be >= 1")
        _require(self.warmup >= 0, f"--warmup {self.warmup} must be >= 0")
        _require(self.repeats >= 1, f"--repeats {self.repeats} must be >= 1")
        _require(self.nproc >= 0, f"--nproc {self.nproc} must be >= 0")
        _choice("bench", "device", self.device, Device)


@dataclass
class CheckConfig:
    """`ddpgpt check`: every path (sync modes, precisions, optimizers, compile, checkpoints,
    signals, eval, sample, export) against its oracle on this machine's device."""

    device: Device = "auto"
    """auto (cuda when available), cpu or cuda: the device every row runs on (the oracles run on
    the CPU in fp32)."""
    quick: bool = False
    """A subset: one compile row (ddp, fp32, W=1) instead of one per mode, precision and W, and
    fewer timed steps in the speed rows (2-core CPU, measured: 2.7 CPU minutes, the full matrix
    3.7; a new graph compiles in 15-55 s; the wall time grows with load: 7.5 min at a load of 6)."""
    out: str = "device-check"
    """Directory for device-check.md, device-check.json and the runs the rows train."""
    nproc: int = 0
    """Processes for the multi-process rows; 0: 2 on CPU (gloo), one per GPU on CUDA (none with
    a single GPU: those rows then say what they need)."""
    compile: bool = True
    """Run the torch.compile rows (--no-compile lists them as not run: each new graph's compile
    takes 15-40 s on a small CPU)."""
    data: str = ""
    """A dataset made by `ddpgpt prepare` to train on; empty: a small byte-level one is prepared
    from the Python standard library into OUT/data (once)."""
    only: str = ""
    """Run only the rows whose check matches one of these comma-separated patterns (shell-style:
    'fsdp2 *,SIGTERM*'; no check's name holds a comma), e.g. to rerun a failed row; empty: every
    row."""

    def __post_init__(self):
        _choice("check", "device", self.device, Device)
        _require(self.nproc >= 0, f"--nproc {self.nproc} must be >= 0 (0: auto)")

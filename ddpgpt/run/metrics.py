"""Rank 0's progress bar and `metrics.jsonl`; throughput and MFU.

metrics.jsonl holds one JSON object per logged step,
    {"step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s", "mfu", "elapsed_s",
     "data_wait_s", "ckpt_wait_s"}
one per evaluation, {"step", "val_loss", "val_bpb"} (bits per byte of the val text; absent for
datasets prepared without byte counts), "train_eval_loss" (a fixed sample of training windows,
data.train_eval_windows; absent when off); of a mixture each source's too, as val_loss/NAME,
val_bpb/NAME, train_eval_loss/NAME, with the share-weighted sums as val_loss etc.; with each
task's scores {NAME_<metric> for its kind's metrics (evals/kinds.py; multiple choice: acc_norm,
acc, acc_char), NAME_n, NAME_s} (run.eval_tasks) and the run's seconds so far {elapsed_s,
train_s, eval_s, checkpoint_s} (train_s: without evaluations and checkpoints), and one per event
a reader of the curves must know about, {"step", "event", ...} (a deliberate switch of dataset
on resume, a settings change, a rollback past a loss spike: guard/spike.py; the first evaluation
at run.target_val_loss: "target", with val_loss, elapsed_s, train_s and tokens). `step` counts
optimizer steps completed (the row after the first step says 1); `tokens` is the global count so
far; `tokens_per_s` is global, over the steps since the previous row (a mixture's rows also hold
mix/NAME, each source's share of the rows since the previous row: the realized proportions);
`mfu` is the model FLOPs per second per process divided by one device's peak; `data_wait_s` and
`ckpt_wait_s` are the seconds per step, averaged over the steps since the previous row, that the
step loop was blocked on its batch (inside the loader's calls, over the step's micro-batches) and
on checkpoints (a save's synchronous part: the copy to host memory, the previous save still in
flight, the lease checked at a URL; a checkpoint after a row counts in the next one), each the
max over ranks (the slowest rank is what a synchronous step waits for: guard/health.py's
exchange carries them). The step line shows `data=N%` when the data wait is over 5% of the step.
On resume the file is cut back to the checkpoint's step, so it never holds a step twice or skips
one.

The peak. A GPU's is its data sheet's. A CPU has none we can trust (turbo, SMT, a VM's share), so
its peak is measured: the best of several matmul windows at startup, the best over the ranks.
On a busy machine every window can read low, and the run itself may then go faster than the
"peak" (MFU rows of 1.05 and 1.39 were seen). So the peak is also raised to any rate the run
itself reaches: it is the best rate known on this machine during the run, never below one, and a
utilization above 1 cannot be written.
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

import torch

from ddpgpt.errors import say
from ddpgpt.evals.kinds import headlines
from ddpgpt.evals.loss import val_text
from ddpgpt.files import WriteError, describe, replace_text
from ddpgpt.progress import bar
from ddpgpt.run.trackers import kept_rows

# Dense bf16 tensor-core peaks (FLOP/s) from the vendors' data sheets.
GPU_BF16_PEAK = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 70e12,
                 "4090": 165e12}


def measure_matmul_flops(device: torch.device, dtype: torch.dtype = torch.float32, n: int = 1024,
                         windows: int = 8, seconds: float = 0.06) -> float:
    """FLOP/s of an n×n matmul on `device` with the current thread settings: the peak MFU is
    measured against on CPU. The best of several short windows: on a shared or virtual machine a
    single window often reads low."""
    # private: the global RNG (dropout) stays untouched
    gen = torch.Generator(device).manual_seed(0)
    a, b = (torch.randn(n, n, dtype=dtype, device=device, generator=gen) for _ in range(2))
    for _ in range(3):
        a @ b
    best = 0.0
    for _ in range(windows):
        count, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            a @ b
            count += 1
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = max(best, 2 * n**3 * count / (time.perf_counter() - start))
    return best


def peak_flops(device: torch.device, dtype: torch.dtype) -> float:
    """One device's peak for MFU, in the dtype the matmuls run in: the data-sheet bf16 figure for
    known GPUs, else measured."""
    if device.type == "cuda" and dtype in (torch.bfloat16, torch.float16):
        name = torch.cuda.get_device_name(device)
        for key, flops in GPU_BF16_PEAK.items():
            if key in name:
                return flops
    # A short measurement: the run's own rate raises the peak where this one reads low (Metrics).
    return measure_matmul_flops(device, dtype, windows=4, seconds=0.04)


DATA_SHOWN = 0.05  # the step line shows the data wait above this share of the step

# The events a start logs at its first step, about itself (what it changed of the checkpoint
# it resumed): a later start from the same checkpoint says them again, or not, for itself.
START_EVENTS = ("data_switch", "mixture_change", "config_change")


def cut_log(path: Path, step: int, start: bool = False) -> None:
    """Drops rows after `step` (written by a run that crashed before its next checkpoint);
    `start` (a start from the checkpoint of `step`): also the start events at `step` of an
    earlier start from the same checkpoint (killed before its next checkpoint and started
    again, it recorded them twice). A rollback to the run's own start keeps them."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
            if row["step"] < step or (row["step"] == step and
                                      not (start and row.get("event") in START_EVENTS)):
                kept.append(line)
        except (ValueError, KeyError, TypeError):
            continue  # a torn last line from a crash
    replace_text(path, "".join(row + "\n" for row in kept))  # whole: a crash keeps the old rows


def evaluated_at(path: Path, step: int) -> dict | None:
    """metrics.jsonl's last evaluation row of `step` (val_loss, val_bpb, ...), if any."""
    found = None
    for row in _rows(path):
        if "val_loss" in row and row.get("step") == step:
            found = row
    return found


def _rows(path: Path):
    """metrics.jsonl's rows, a torn last line (a crash) skipped; none without the file."""
    if not path.is_file():
        return
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            yield row


def trained_to(path: Path) -> int:
    """The last training step metrics.jsonl records (0: none, or no file): how far a run dir
    has trained, whatever became of its checkpoints."""
    reached = 0
    for row in _rows(path):
        try:
            if "loss" in row:
                reached = max(reached, int(row["step"]))
        except (ValueError, KeyError, TypeError):
            continue
    return reached


def data_share(data_wait_s: float, step_s: float, above: float = DATA_SHOWN) -> str:
    """The step line's word on the data wait: its share of the step ("12%") when more than
    `above` of it, else "" (a few percent is noise, not a loader to fix)."""
    if step_s <= 0 or data_wait_s <= above * step_s:
        return ""
    return f"{min(data_wait_s / step_s, 1.0):.0%}"


class Metrics:
    """On rank 0: a progress bar (loss, tokens/s, ETA), metrics.jsonl and the tracker that
    mirrors it (trackers.py), if any. Elsewhere: silent no-ops."""

    def __init__(self, enabled: bool, path: Path, start_step: int, total_steps: int,
                 tokens_per_step: int, flops_per_token: float, peak: float, world_size: int,
                 tracker=None):
        self.enabled, self.tracker = enabled, tracker
        self.tokens_per_step, self.flops_per_token = tokens_per_step, flops_per_token
        self.peak, self.world_size = peak, world_size  # one device's, raised by what runs faster
        self.mark, self.mark_step = time.perf_counter(), start_step
        self.taken_mark: dict[str, int] | None = None  # a mixture's rows per source at the mark
        self.waits = [0.0, 0.0]  # seconds waited for data, for checkpoints, since the mark
        if not enabled:
            return
        self.path = Path(path)
        cut_log(self.path, start_step, start=True)
        self.file = open(self.path, "a")
        # On a terminal a bar redrawn in place; in a log file whole lines only (progress.bar):
        # no carriage returns, no blank line where the bar steps aside for a `step N:` line.
        self.bar = bar(total=total_steps, initial=start_step, desc="train", unit="step")

    def _write(self, row: dict) -> None:
        try:
            self.file.write(json.dumps(row) + "\n")
            self.file.flush()
        except OSError as e:
            raise WriteError(f"cannot write {self.path}: {describe(e)}") from None
        if self.tracker is not None and "event" not in row:
            self.tracker.log(row["step"], row)

    def waited(self, data_s: float, ckpt_s: float) -> None:
        """A step's waits (Health's: the max over ranks), for the next row's means."""
        self.waits[0] += data_s
        self.waits[1] += ckpt_s

    def log_step(self, step: int, loss: float | None, lr: float, grad_norm: float | None,
                 elapsed_s: float, taken: dict[str, int] | None = None) -> dict:
        """A training row; loss and grad_norm are null for a step skipped as non-finite.
        `taken`: a mixture's rows so far from each source (MixtureLoader.taken_now): the row
        then holds mix/NAME, each source's share of the rows since the previous row."""
        now = time.perf_counter()
        steps = max(step - self.mark_step, 1)
        tps = (step - self.mark_step) * self.tokens_per_step / max(now - self.mark, 1e-9)
        data_wait, ckpt_wait = (w / steps for w in self.waits)
        share = data_share(data_wait, (now - self.mark) / steps)
        self.mark, self.mark_step, self.waits = now, step, [0.0, 0.0]
        per_device = tps * self.flops_per_token / self.world_size  # model FLOP/s per process
        self.peak = max(self.peak, per_device)
        row = {"step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm,
               "tokens": step * self.tokens_per_step, "tokens_per_s": tps,
               "mfu": per_device / self.peak, "elapsed_s": elapsed_s,
               "data_wait_s": data_wait, "ckpt_wait_s": ckpt_wait, **self._mix(taken)}
        if self.enabled:
            self._write(row)
            self.bar.set_postfix(loss="skipped" if loss is None else f"{loss:.4f}",
                                 lr=f"{lr:.3g}", tok_s=f"{tps:,.0f}",
                                 **({"data": share} if share else {}), refresh=False)
            self.bar.update(step - self.bar.n)
        return row

    def _mix(self, taken: dict[str, int] | None) -> dict:
        """{mix/NAME: share of the rows since the previous mark}; {} without a mixture, on the
        first row, or after a rollback moved the counts back."""
        if taken is None:
            return {}
        before, self.taken_mark = self.taken_mark, taken
        delta = {n: c - (before or {}).get(n, 0) for n, c in taken.items()}
        total = sum(delta.values())
        if before is None or total <= 0 or min(delta.values()) < 0:
            return {}
        return {f"mix/{n}": d / total for n, d in delta.items()}

    @contextlib.contextmanager
    def paused(self):
        """Time inside (evaluation, checkpoints, samples) counts neither against tokens_per_s nor
        in the bar's time per step: the bar's clock is moved on by as much."""
        start = time.perf_counter()
        try:
            yield
        finally:
            spent = time.perf_counter() - start
            self.mark += spent
            if self.enabled and not self.bar.disable:
                self.bar.start_t += spent
                self.bar.last_print_t += spent

    def finish_bar(self) -> None:
        """The bar at its last step, closed with its time per step as it is, before the final
        evaluation shows its own progress."""
        if self.enabled:
            self.bar.close()

    def log_eval(self, step: int, val_loss: float, val_bpb: float | None = None,
                 **fields) -> None:
        """An eval row: `fields` are the tasks' scores (NAME_acc_norm, ...; the line shows each
        task's headline score, evals/kinds.py) and the run's seconds
        (elapsed_s, train_s, eval_s, checkpoint_s)."""
        if self.enabled:
            row = {"step": step, "val_loss": val_loss}
            if val_bpb is not None:
                row["val_bpb"] = val_bpb
            self._write({**row, **fields})
            tasks = "".join(f", {name} {fields[key]:.4f}"
                            for name, key in headlines(fields).items())
            train = fields.get("train_eval_loss")
            self.bar.write(f"step {step}: {val_text({'val_loss': val_loss, **fields})}"
                           + ("" if val_bpb is None else f", val_bpb {val_bpb:.4f}")
                           + ("" if train is None else f", train_eval_loss {train:.4f}") + tasks)

    def log_target(self, step: int, row: dict, target: float) -> None:
        """Time to target: the event row of the first evaluation at run.target_val_loss, and
        its line."""
        tokens = step * self.tokens_per_step
        self.log_event(step, "target", val_loss=row["val_loss"], target=target,
                       elapsed_s=row["elapsed_s"], train_s=row["train_s"], tokens=tokens)
        self.write(f"reached val loss {target:g} ({row['val_loss']:.4f}) at step {step}, "
                   f"{row['elapsed_s']:.1f} s "
                   f"({row['train_s']:.1f} s training), {tokens:,} tokens")

    def write(self, line: str) -> None:
        """A line on stderr (rank 0's) that does not tear the progress bar."""
        if self.enabled:
            say(line)

    def rewind(self, step: int) -> None:
        """Back to `step` (a rollback): the rows after it go, as on resume, and the bar with
        them; the throughput is measured afresh from here."""
        self.mark, self.mark_step, self.waits = time.perf_counter(), step, [0.0, 0.0]
        if self.enabled:
            self.file.close()
            cut_log(self.path, step)
            if self.tracker is not None:
                self.tracker.rewind(step, kept_rows(self.path, step))
            self.file = open(self.path, "a")
            self.bar.n = step
            self.bar.refresh()

    def log_event(self, step: int, event: str, **fields) -> None:
        """Something a reader of the curves must know happened at `step` (a data switch, a
        rollback)."""
        if self.enabled:
            self._write({"step": step, "event": event, **fields})

    def close(self) -> None:
        if self.enabled:
            self.bar.close()
            self.file.close()
        if self.tracker is not None:
            self.tracker.close()
            self.tracker = None


def summary(trainer) -> str:
    """One line on what the Trainer runs where: processes, nodes, batch arithmetic, size."""
    env, cfg = trainer.env, trainer.cfg
    nodes = env.world_size // env.local_world_size
    where = f"{env.world_size} process{'es' if env.world_size > 1 else ''}"
    if env.world_size > 1:
        where += (f" ({nodes} node{'s' if nodes > 1 else ''} × {env.local_world_size}, "
                  f"{env.backend})")
    G, T = cfg.data.global_batch, cfg.seq_len
    return (f"ddpgpt: training on {where}, {env.device.type}, {cfg.run.precision}; "
            f"G={G} sequences × T={T} = "
            f"{G * T:,} tokens per step = {env.world_size} × A={trainer.accum} micro-steps × "
            f"b={cfg.data.micro_batch}; "
            f"{trainer.raw.num_params(non_embedding=False) / 1e6:.2f}M parameters")


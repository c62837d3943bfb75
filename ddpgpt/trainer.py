"""The Trainer: the training state and one optimizer step. What resumes lives here, each part
with its own state_dict(); the run's story (setup, the loop, saving, rolling back) is
commands/train.py's.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import time
from collections.abc import Iterable, Iterator
from typing import get_args

import torch

from ddpgpt.checkpoint import read, sharded, store
from ddpgpt.config.choices import Optimizer
from ddpgpt.config.schema import TrainConfig
from ddpgpt.data.mixture import MixedDataset, train_loader
from ddpgpt.data.shards import TokenDataset
from ddpgpt.distributed import collectives
from ddpgpt.distributed.group import DistEnv, collective
from ddpgpt.evals.loss import eval_sets, evaluate, evaluate_sets
from ddpgpt.evals.scorer import Scorer
from ddpgpt.guard.health import Guard
from ddpgpt.model.gpt import GPT
from ddpgpt.optim import optimizer
from ddpgpt.optim.optimizer import set_lr
from ddpgpt.optim.schedule import Rates, Schedule
from ddpgpt.run.precision import Precision
from ddpgpt.run.preflight import accum_steps
from ddpgpt.sync.base import make_sync

# What dynamo says, on every compile, of the profiler's record_function ranges it leaves out of
# the graph (DDP's forward opens one): nothing a user can act on, so not printed.
PROFILER_NOTES = {"torch._dynamo.variables.ctx_manager": "Profiler record function ",
                  "torch._dynamo.variables.torch": "Profiler function "}


class _Without(logging.Filter):
    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


def first_step_waits(compile: bool, kernels: str, device_type: str, flex: bool) -> str:
    """What a run's first step waits for, in one line ("" for nothing worth saying), or the bar
    sits at 0 for tens of seconds with no word of why. `flex`: FlexAttention runs on this device
    (compiled on its own unless the whole model is)."""
    waits = []
    if compile:
        waits.append("torch.compile (run.compile: tens of seconds)")
    elif kernels == "compiled" and device_type == "cpu":
        waits.append("torch.compile's kernels (model.kernels compiled: seconds, tens on a new "
                     "machine)")
    if flex and not compile:
        waits.append("FlexAttention's kernel (model.attention flex: tens of seconds)")
    return (f"ddpgpt: the first step waits for {' and '.join(waits)}; the compiled kernels are "
            "cached for later runs") if waits else ""


def compiled(model: torch.nn.Module) -> torch.nn.Module:
    """torch.compile(model), dynamo's profiler notes filtered out where it logs them."""
    for name, prefix in PROFILER_NOTES.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _Without) for f in logger.filters):
            logger.addFilter(_Without(prefix))
    return torch.compile(model)


class Trainer:
    """The training state and the step. Whatever resumes lives here, each part with its own
    state_dict(): the model, the optimizer, the loss scaler, the loader's cursor, the guard's
    count of skipped steps and its spike detector, the progress (step, elapsed time) and every
    rank's RNG."""

    def __init__(self, cfg: TrainConfig, env: DistEnv, dataset: TokenDataset | MixedDataset,
                 guard: Guard, local: bool = False, init: dict | None = None, digest: bool = True):
        """Built in one direction: the model, the sync mode around it, the optimizer over the
        parameters as the mode left them; a checkpoint is loaded into those (load_state_dict).
        `local`: no collective at all, each rank on its own micro-batches (bench's baseline).
        `init`: pretrained weights (--init-from) to start from instead of the seed's. `digest`:
        take `init_digest` (a start from scratch compares it across ranks; a resume does not)."""
        self.cfg, self.env, self.dataset, self.guard = cfg, env, dataset, guard
        self.world = 1 if local else env.world_size  # the ranks whose gradients the sync averages
        dev, data, run = env.device, cfg.data, cfg.run
        self.accum = accum_steps(cfg, env.world_size)
        # 1. The same weights on every rank: drawn from run.seed by the model's private generator,
        #    never from a global RNG that some code might have seeded per rank.
        self.raw = GPT(cfg.model, seed=run.seed).to(dev)  # the single-device model
        if init is not None:  # before the digest and the sync: as if the model were built so
            self.raw.load_state_dict(init)
        # What this rank built, before any sharding: fsdp2 would otherwise show every rank the
        # same gathered mix of the ranks' shards, whatever each built.
        self.init_digest = collectives.state_digest(self.raw.state_dict()) if digest else None
        # 2. The sync mode wraps it (DDP, gradient buckets, zero1's flat buffers, fsdp2's shards)
        #    and says what this rank steps; the optimizer is built over exactly that.
        groups = optimizer.groups(self.raw, cfg.optim)
        self.sync = make_sync(None if local else run.sync, self.raw, groups, env, run.bucket_mb,
                              run.grad_compress)
        self.precision = Precision.of(run, dev)
        self.scaler = self.precision.scaler()  # fp16: it must see every gradient held
        ns_dtype = self.precision.newton_schulz_dtype(cfg.optim.muon_ns_dtype)
        self.optimizer = optimizer.Optimizer(groups, self.sync.params(), cfg.optim, dev,
                                             held=self.sync.held() if self.scaler else (),
                                             ns_dtype=ns_dtype)
        # Each step's lr and momentum; a rollback's lower lr comes from the guard at each step.
        self.schedule = Schedule(cfg.optim, run.steps, lambda: guard.spikes.lr_factor)
        # 3. Compile after the sync: for DDP, dynamo's DDPOptimizer then splits the graph at
        #    DDP's bucket boundaries, so each bucket's all-reduce overlaps the backward.
        self.model = compiled(self.sync.model) if run.compile else self.sync.model
        self.autocast = self.precision.autocast
        # 4. This rank's share of the data; the order is the loader's, not a per-rank seed's.
        self.loader = train_loader(dataset, seq_len=cfg.seq_len, micro_batch=data.micro_batch,
                                   world_size=env.world_size, rank=env.rank,
                                   accum_steps=self.accum, seed=data.seed, shuffle=data.shuffle,
                                   device=dev, align=data.align, cache=data.cache)
        # Each evaluation's windows: val, and a training sample drawn by data.seed (each source's).
        self.evals = eval_sets(dataset, seq_len=cfg.seq_len, micro_batch=data.micro_batch,
                               world_size=env.world_size, rank=env.rank,
                               eval_windows=data.eval_windows,
                               train_windows=data.train_eval_windows, seed=data.seed, device=dev,
                               align=data.align, cache=data.cache)
        self.step = 0                 # optimizer steps completed
        self.batch = 0                # the global batch the newest step read
        self.doing = "step 1"         # what the loop is at, for a failure's message
        self.last_checkpoint = -1     # the step of the newest checkpoint this run can fall back to
        self.origin: dict | None = None  # the explicit --resume PATH this run descends from
        self.other_data = False       # resumed on other data than the checkpoint's (restore)
        self._elapsed_before, self._started = 0.0, time.perf_counter()
        # Of that wall time, the seconds spent evaluating and blocked on checkpoints (timed).
        self.eval_s = self.checkpoint_s = 0.0
        # What the step loop waited for, this rank's, until the next health exchange reports
        # it (the max over ranks is what a synchronous step waits): the batch of the step
        # (train_step: inside the loader's calls), and checkpoints (timed: the save's copy to
        # host memory, the previous save still in flight, the lease checked at a URL).
        self.data_wait_s = self.ckpt_wait_s = 0.0
        self._seed_rng(0)

    @property
    def elapsed_s(self) -> float:
        """Wall time of the run so far, across resumes."""
        return self._elapsed_before + time.perf_counter() - self._started

    @contextlib.contextmanager
    def timed(self, what: str):
        """Counts the time inside into eval_s or checkpoint_s (`what`: eval, checkpoint; a
        checkpoint's into ckpt_wait_s too)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            spent = time.perf_counter() - start
            setattr(self, f"{what}_s", getattr(self, f"{what}_s") + spent)
            if what == "checkpoint":
                self.ckpt_wait_s += spent

    def first_step_waits(self) -> str:
        return first_step_waits(self.cfg.run.compile, self.cfg.model.kernels,
                                self.env.device.type, self.env.device.type in self.raw.flex_on)

    def times(self) -> dict:
        """The run's seconds so far: wall time, and training time apart from evaluations and
        checkpoints (what a time-to-target comparison counts)."""
        elapsed = self.elapsed_s
        return {"elapsed_s": elapsed, "train_s": elapsed - self.eval_s - self.checkpoint_s,
                "eval_s": self.eval_s, "checkpoint_s": self.checkpoint_s}

    def _seed_rng(self, step: int) -> None:
        """This rank's global RNG (dropout) from (seed, rank, step): masks differ per rank."""
        torch.manual_seed(self.cfg.run.seed + 1 + self.env.rank + 1_000_003 * step)

    # ---- state ------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Collective: every rank's RNG state is gathered, so every rank must call it."""
        env = self.env
        rng = {"cpu": collectives.all_gather(env, torch.get_rng_state().to(env.device)).cpu()}
        if env.device.type == "cuda":
            rng["cuda"] = collectives.all_gather(
                env, torch.cuda.get_rng_state(env.device).to(env.device)).cpu()
        return {"model": self.sync.model_state(),
                "optimizer": self.sync.optimizer_state(self.optimizer), "rng": rng,
                **self._rest()}

    def _rest(self) -> dict:
        """The state beside the tensors: the scaler, the loader's cursor, the guard and its spike
        detector, the progress."""
        return {"scaler": self.scaler.state_dict() if self.scaler else None,
                "loader": self.loader.state_dict(), "guard": self.guard.state_dict(),
                "progress": {"step": self.step, "elapsed_s": self.elapsed_s,
                             "eval_s": self.eval_s, "checkpoint_s": self.checkpoint_s}}

    def load_state_dict(self, state: dict, saved_world_size: int, new_data: bool = False,
                        where: str = "checkpoint") -> None:
        """Into the model and optimizer as the sync mode laid them out (whatever mode and W saved
        the state). `new_data`: a deliberate switch to another dataset, whose windows the loader
        starts from the beginning; `where`: the state's name in an error."""
        saved = optimizer.upgrade(state["optimizer"])
        optimizer.check_groups(self.optimizer, saved, where)
        self.sync.load_model_state(state["model"])
        # this run's hyperparameters win over the saved ones
        self.sync.load_optimizer_state(self.optimizer, saved)
        rng = None
        if saved_world_size == self.env.world_size:
            rng = {k: v[self.env.rank] for k, v in state["rng"].items() if v is not None}
        self._load_rest(state, new_data, rng)

    # ---- the sharded checkpoint (sharded.py, saver.py) ------------------------------------------

    def shard_state(self) -> tuple[dict[str, sharded.Pieces], set[str], dict]:
        """What a checkpoint takes from this rank, with no copy and no collective: every tensor it
        holds, as chunks of the single-device model's tensors (sharded.py); the names of those
        every rank holds alike; and the small rest (a snapshot; rank 0's is written)."""
        held, replicated = self.sync.checkpoint_state(self.optimizer)
        held.update(sharded.rng(self.env))
        rest = {"optimizer": self.sync.optimizer_rest(self.optimizer), **self._rest()}
        return held, replicated, copy.deepcopy(rest)

    def restore(self, path, meta: dict, new_data: bool = False) -> None:
        """Loads checkpoint `path`, whatever mode and W wrote it. Format 3: in place, each rank
        reading only the chunks it holds, so no rank ever holds the whole state, with no
        collective (ranks that disagree on the checkpoint are named by `setup` afterwards);
        formats 1-2: whole, through load_state_dict."""
        if int(meta["format_version"]) < 3:
            self.load_state_dict(read.load(path, meta), meta["world_size"], new_data,
                                 f"checkpoint {path}")
            return
        index, rest = read.open_sharded(path, meta)
        saved = set(index.state_dict_metadata)
        create = tuple(kind for kind in get_args(Optimizer)
                       if any(k.startswith(f"optimizer.{kind}.") for k in saved))
        targets, _ = self.sync.checkpoint_state(self.optimizer, create)
        missing = sorted(k for k in targets if k not in saved)
        if missing:  # resume._check_fit compared the shapes; this checkpoint lacks tensors
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise store.CheckpointError(
                f"{path}: the checkpoint holds no {missing[0]}{more}; it was not written by "
                "this model and optimizer: resume from another one, or --reset")
        same = int(meta["world_size"]) == self.env.world_size
        rng = sharded.rng(self.env, fresh=True) if same else {}
        read.read_into(path, index,
                       {k: v for k, v in {**targets, **rng}.items() if k in saved})
        self.sync.set_adamw_steps(self.optimizer, rest["optimizer"]["adamw"]["step"])
        self._load_rest(rest, new_data, {k[4:]: p.chunks[0][1].view(-1) for k, p in rng.items()
                                         if k in saved} if same else None)

    def _load_rest(self, state: dict, new_data: bool, rng: dict | None) -> None:
        """The scaler, the loader's cursor, the guard and its spike detector (started anew on
        other data), the progress, and this rank's generators (`rng`, when the world size is the
        one that saved them; else fresh streams)."""
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        if not new_data:
            self.loader.load_state_dict(state["loader"])
        self.guard.load_state_dict(state["guard"], state.get("spike"))
        # Other data than the checkpoint's, or other mixture weights: the loss spike guard's
        # baselines were the old data's (SpikePolicy.anew)
        self.other_data = new_data or bool(getattr(self.loader, "changed", None))
        if self.other_data:
            self.guard.spikes.anew()
        self.step = self.last_checkpoint = int(state["progress"]["step"])
        progress = state["progress"]
        self._elapsed_before, self._started = float(progress["elapsed_s"]), time.perf_counter()
        self.eval_s = float(progress.get("eval_s", 0.0))  # 0: saved before they were counted
        self.checkpoint_s = float(progress.get("checkpoint_s", 0.0))
        if rng is not None:
            # clone(): set_rng_state crashes (torch 2.13) on a view with an offset
            torch.set_rng_state(rng["cpu"].clone())
            if rng.get("cuda") is not None and self.env.device.type == "cuda":
                torch.cuda.set_rng_state(rng["cuda"].clone(), self.env.device)
        else:  # another W: per-rank streams cannot carry over; fresh ones from (seed, step, rank)
            self._seed_rng(self.step)

    def unwrap(self) -> None:
        """No DDP wrapper or hook may outlive the process group (see group.shutdown)."""
        if self.sync is not None:
            self.sync.close()
        self.model = self.raw

    def close(self) -> None:
        """Unwrapped, and the model, optimizer and gradients let go: a rollback builds new ones,
        and both at once may not fit on the device."""
        self.unwrap()
        self.raw = self.model = self.optimizer = self.sync = None

    # ---- the step ---------------------------------------------------------------------------

    def train_step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward/backward over this rank's A micro-batches, gradients synced once, at the last.
        Returns (this rank's share of the loss: the mean over ranks of it is the global mean
        loss; the global gradient norm before clipping)."""
        self.batch = self.loader.batch_index  # the global batch this step reads
        self.data_wait_s = 0.0
        loss_sum = torch.zeros((), device=self.env.device)
        # A lost peer shows in whichever collective comes first: the last backward's (DDP, the
        # buckets), any forward's (fsdp2 gathers each block's weights), finish()'s or the norm's.
        with collective() if self.env.world_size > 1 else contextlib.nullcontext():
            batches, weight = self._batches()
            for m, (x, y) in enumerate(batches):
                last = m == self.accum - 1
                # Before the last micro-step no gradient is synced: they accumulate locally.
                with self.sync.micro_step(last):
                    with self.autocast():
                        if weight is None:  # mean over this micro-batch's b·T tokens
                            _, loss = self.model(x, y)
                        else:  # summed over its unmasked targets, each weighted W / N
                            _, loss = self.model(x, y, reduction="sum")
                            loss = loss * weight
                    # /A: summed over micro-steps, then averaged over W ranks by the sync, the
                    # gradient is that of the mean loss over the global batch (T targets each).
                    # With a mask, W / N: the sync's mean over W then leaves the sum over the
                    # global batch's N unmasked targets divided by N, at any W, A and b.
                    scaled = loss / self.accum if weight is None else loss
                    (self.scaler.scale(scaled) if self.scaler else scaled).backward()
                loss_sum += loss.detach()
            self.sync.finish()
            if self.scaler is not None:
                self.scaler.unscale_(self.optimizer)
            # After the sync every rank holds the same gradients, so this is the global norm.
            norm = self.sync.clip(self.cfg.optim.grad_clip or float("inf"))
        return (loss_sum / self.accum if weight is None else loss_sum), norm

    def _batches(self) -> tuple[Iterable[tuple[torch.Tensor, torch.Tensor]], torch.Tensor | None]:
        """This rank's micro-batches of the next step, and, when some targets are masked out
        (conversations: -1), the weight of each unmasked target's loss, W / N for the N unmasked
        targets of the whole global batch (every rank, every micro-step): the step's batches are
        read up front and N is one all-reduce of a count, before the first backward. (The
        count of every rank's rows could be known without it only by reading every rank's
        masks, or by a table of every row's count kept beside the data.) None: no mask, the
        plain mean, as fast as ever."""
        start = time.perf_counter()
        batches = self._waited(self.loader.next_step())  # (names the windows to fetch ahead)
        self.data_wait_s += time.perf_counter() - start
        if not self.loader.masked:
            return batches, None
        batches = list(batches)
        count = torch.stack([(y >= 0).sum() for _, y in batches]).sum().double()
        if self.world > 1:  # (bench's no-collective baseline: each rank its own N)
            collectives.all_reduce(self.env, count)
        return batches, (self.world / count.clamp(min=1)).float()  # no target at all: loss 0

    def _waited(self, batches: Iterable) -> Iterator:
        """`batches`, the time inside each read (the step blocked on its data) added to
        data_wait_s."""
        batches = iter(batches)
        while True:
            start = time.perf_counter()
            try:
                item = next(batches)
            except StopIteration:
                return
            finally:
                self.data_wait_s += time.perf_counter() - start
            yield item

    def evaluate(self, tasks: Scorer | None = None, progress: bool = False) -> dict:
        """An eval row: val_loss and val_bpb, train_eval_loss (data.train_eval_windows; a
        mixture's each source's too: evals/loss.py), the tasks' scores, the run's seconds
        (times()). Collective: every rank calls it. `progress`: bars on rank 0."""
        with self.timed("eval"):
            row = evaluate_sets(self.raw, self.evals, self.env, self.autocast, progress)
            scores = tasks.score(self.raw, self.autocast, progress) if tasks else {}
        return {**row, **scores, **self.times()}

    def probe(self, batch: int) -> float:
        """The global mean loss of the weights as they are on global batch `batch` (no update,
        no gradient, no RNG drawn): each rank its share, one all-reduce. Collective."""
        with collective() if self.env.world_size > 1 else contextlib.nullcontext():
            return evaluate(self.raw, self.loader.batch(batch), self.env, self.autocast)

    def update(self, rates: Rates) -> None:
        """The optimizer step at `rates` (the schedule's for this step: self.schedule.at)."""
        set_lr(self.optimizer, rates.lr, rates.momentum)
        self.sync.before_update()  # fsdp2: Muon's matrices, whole, to their owners
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.sync.after_update()  # every rank gets the parameters that others updated
        self.sync.zero_grad()

    def skip_update(self) -> None:
        """A step skipped for a non-finite value: its gradients are dropped. The scaler still
        closes the step (update() lowers the scale after an overflow); without it the next
        step's unscale_() would refuse to run."""
        if self.scaler is not None:
            self.scaler.update()
        self.sync.zero_grad()


# ---- the loop ------------------------------------------------------------------------------------

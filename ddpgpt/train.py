"""`ddpgpt train`: one code path for one process, N local processes, and many nodes.

    ddpgpt train --data data/stdlib --preset tiny                      # one process (CPU or a GPU)
    ddpgpt train --data data/stdlib --preset tiny --nproc 2            # 2 local processes
    torchrun --standalone --nproc_per_node 8 -m ddpgpt train --data data/fineweb --preset gpt2-124m
    torchrun --nnodes 2 --nproc_per_node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        -m ddpgpt train --data data/fineweb --preset gpt2-124m
    ddpgpt train --data data/stdlib --preset tiny --run.steps 20 --device cpu   # a tiny CPU run

The global batch G (data.global_batch sequences) is fixed by the config; with W processes of
micro-batch b, each optimizer step accumulates A = G / (W·b) micro-steps. The windows of step k
depend only on (seed, T, G, k), so the optimizer takes the same steps whatever W is.

The loop reads: the batch and its forward/backward (gradients synced once, at the last
micro-step) -> the health exchange (one all_gather: global loss, non-finite values, stop
requests; see reliability.py) -> the update -> log, evaluate, save.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import json
import os
import sys
import time

import torch

from ddpgpt import __version__, checkpoint, dist, optim, sync
from ddpgpt.checkpoint import sharded
from ddpgpt.checkpoint.saver import Saver, save, settle
from ddpgpt.checkpoint.saver import token as saver_token
from ddpgpt.config.schema import TrainConfig
from ddpgpt.data.loader import EvalLoader, TrainLoader
from ddpgpt.data.shards import TokenDataset
from ddpgpt.errors import UserError, warn
from ddpgpt.evaluate import evaluate
from ddpgpt.guard.health import Guard, StopSignal, collective_failed, preempted, resume_hint
from ddpgpt.guard.spike import Verdict, json_number, target
from ddpgpt.model import GPT
from ddpgpt.optim.muon import momentum_at
from ddpgpt.optim.optimizer import lr_at, set_lr
from ddpgpt.run import elastic, resume, trackers
from ddpgpt.run.metrics import Metrics, peak_flops
from ddpgpt.run.precision import autocast, configure, grad_scaler, matmul_dtype
from ddpgpt.run.preflight import accum_steps, preflight, shared
from ddpgpt.run.run_dir import RunDir


class Trainer:
    """The training state and the step. Whatever resumes lives here, each part with its own
    state_dict(): the model, the optimizer, the loss scaler, the loader's cursor, the guard's
    count of skipped steps and its spike detector, the progress (step, elapsed time) and every
    rank's RNG."""

    def __init__(self, cfg: TrainConfig, env: dist.DistEnv, dataset: TokenDataset, guard: Guard,
                 local: bool = False, init: dict | None = None, digest: bool = True):
        """Built in one direction: the model, the sync mode around it, the optimizer over the
        parameters as the mode left them; a checkpoint is loaded into those (load_state_dict).
        `local`: no collective at all, each rank on its own micro-batches (bench's baseline).
        `init`: pretrained weights (--init-from) to start from instead of the seed's. `digest`:
        take `init_digest` (a start from scratch compares it across ranks; a resume does not)."""
        self.cfg, self.env, self.dataset, self.guard = cfg, env, dataset, guard
        dev, data, run = env.device, cfg.data, cfg.run
        self.accum = accum_steps(cfg, env.world_size)
        # 1. The same weights on every rank: drawn from run.seed by the model's private generator,
        #    never from a global RNG that some code might have seeded per rank.
        self.raw = GPT(cfg.model, seed=run.seed).to(dev)  # the single-device model
        if init is not None:  # before the digest and the sync: as if the model were built so
            self.raw.load_state_dict(init)
        # What this rank built, before any sharding: fsdp2 would otherwise show every rank the
        # same gathered mix of the ranks' shards, whatever each built.
        self.init_digest = dist.state_digest(self.raw.state_dict()) if digest else None
        # 2. The sync mode wraps it (DDP, gradient buckets, zero1's flat buffers, fsdp2's shards)
        #    and says what this rank steps; the optimizer is built over exactly that.
        groups = optim.groups(self.raw, cfg.optim)
        self.sync = sync.make(None if local else run.sync, self.raw, groups, env, run.bucket_mb,
                              run.grad_compress)
        self.scaler = grad_scaler(run.precision, dev)  # fp16: it must see every gradient held
        ns_dtype = torch.float32 if run.precision == "fp32" else torch.bfloat16
        self.optimizer = optim.Optimizer(groups, self.sync.params(), cfg.optim, dev,
                                         held=self.sync.held() if self.scaler else (),
                                         ns_dtype=ns_dtype)
        # 3. Compile after the sync: for DDP, dynamo's DDPOptimizer then splits the graph at
        #    DDP's bucket boundaries, so each bucket's all-reduce overlaps the backward.
        self.model = torch.compile(self.sync.model) if run.compile else self.sync.model
        self.autocast = autocast(cfg.run.precision, dev)
        # 4. This rank's share of the data; the order is the loader's, not a per-rank seed's.
        self.loader = TrainLoader(dataset, seq_len=cfg.seq_len, micro_batch=data.micro_batch,
                                  world_size=env.world_size, rank=env.rank, accum_steps=self.accum,
                                  seed=data.seed, shuffle=data.shuffle, device=dev)
        self.val = EvalLoader(dataset, seq_len=cfg.seq_len, micro_batch=data.micro_batch,
                              world_size=env.world_size, rank=env.rank,
                              max_windows=data.eval_windows, device=dev)
        self.step = 0                 # optimizer steps completed
        self.batch = 0                # the global batch the newest step read
        self.doing = "step 1"         # what the loop is at, for a failure's message
        self.last_checkpoint = -1     # the step of the newest checkpoint this run can fall back to
        self.origin: dict | None = None  # the explicit --resume PATH this run descends from
        self._elapsed_before, self._started = 0.0, time.perf_counter()
        self._seed_rng(0)

    @property
    def elapsed_s(self) -> float:
        """Wall time of the run so far, across resumes."""
        return self._elapsed_before + time.perf_counter() - self._started

    def _seed_rng(self, step: int) -> None:
        """This rank's global RNG (dropout) from (seed, rank, step): masks differ per rank."""
        torch.manual_seed(self.cfg.run.seed + 1 + self.env.rank + 1_000_003 * step)

    # ---- state ------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Collective: every rank's RNG state is gathered, so every rank must call it."""
        env = self.env
        rng = {"cpu": dist.all_gather(env, torch.get_rng_state().to(env.device)).cpu()}
        if env.device.type == "cuda":
            rng["cuda"] = dist.all_gather(env,
                                          torch.cuda.get_rng_state(env.device).to(env.device)).cpu()
        return {"model": self.sync.model_state(),
                "optimizer": self.sync.optimizer_state(self.optimizer), "rng": rng,
                **self._rest()}

    def _rest(self) -> dict:
        """The state beside the tensors: the scaler, the loader's cursor, the guard and its spike
        detector, the progress."""
        return {"scaler": self.scaler.state_dict() if self.scaler else None,
                "loader": self.loader.state_dict(), "guard": self.guard.state_dict(),
                "progress": {"step": self.step, "elapsed_s": self.elapsed_s}}

    def load_state_dict(self, state: dict, saved_world_size: int, new_data: bool = False) -> None:
        """Into the model and optimizer as the sync mode laid them out (whatever mode and W saved
        the state). `new_data`: a deliberate switch to another dataset, whose windows the loader
        starts from the beginning."""
        self.sync.load_model_state(state["model"])
        # this run's hyperparameters win over the saved ones
        self.sync.load_optimizer_state(self.optimizer, optim.upgrade(state["optimizer"]))
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
            self.load_state_dict(checkpoint.load(path, meta), meta["world_size"], new_data)
            return
        index, rest = checkpoint.open_sharded(path, meta)
        saved = set(index.state_dict_metadata)
        create = tuple(kind for kind in ("adamw", "muon")
                       if any(k.startswith(f"optimizer.{kind}.") for k in saved))
        targets, _ = self.sync.checkpoint_state(self.optimizer, create)
        missing = sorted(k for k in targets if k not in saved)
        if missing:  # resume._check_fit compared the shapes; this checkpoint lacks tensors
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise checkpoint.CheckpointError(
                f"{path}: the checkpoint holds no {missing[0]}{more}; it was not written by "
                "this model and optimizer: resume from another one, or --reset")
        same = int(meta["world_size"]) == self.env.world_size
        rng = sharded.rng(self.env, fresh=True) if same else {}
        checkpoint.read_into(path, index,
                             {k: v for k, v in {**targets, **rng}.items() if k in saved})
        self.sync.set_adamw_steps(self.optimizer, rest["optimizer"]["adamw"]["step"])
        self._load_rest(rest, new_data, {k[4:]: p.chunks[0][1].view(-1) for k, p in rng.items()
                                         if k in saved} if same else None)

    def _load_rest(self, state: dict, new_data: bool, rng: dict | None) -> None:
        """The scaler, the loader's cursor, the guard and its spike detector, the progress, and
        this rank's generators (`rng`, when the world size is the one that saved them; else
        fresh streams)."""
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        if not new_data:
            self.loader.load_state_dict(state["loader"])
        self.guard.load_state_dict(state["guard"], state.get("spike"))
        self.step = self.last_checkpoint = int(state["progress"]["step"])
        self._elapsed_before, self._started = (float(state["progress"]["elapsed_s"]),
                                               time.perf_counter())
        if rng is not None:
            # clone(): set_rng_state crashes (torch 2.13) on a view with an offset
            torch.set_rng_state(rng["cpu"].clone())
            if rng.get("cuda") is not None and self.env.device.type == "cuda":
                torch.cuda.set_rng_state(rng["cuda"].clone(), self.env.device)
        else:  # another W: per-rank streams cannot carry over; fresh ones from (seed, step, rank)
            self._seed_rng(self.step)

    def unwrap(self) -> None:
        """No DDP wrapper or hook may outlive the process group (see dist.shutdown)."""
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
        Returns (this rank's mean loss, the global gradient norm before clipping)."""
        self.batch = self.loader.batch_index  # the global batch this step reads
        loss_sum = torch.zeros((), device=self.env.device)
        # A lost peer shows in whichever collective comes first: the last backward's (DDP, the
        # buckets), any forward's (fsdp2 gathers each block's weights), finish()'s or the norm's.
        with dist.collective() if self.env.world_size > 1 else contextlib.nullcontext():
            for m, (x, y) in enumerate(self.loader.next_step()):
                last = m == self.accum - 1
                # Before the last micro-step no gradient is synced: they accumulate locally.
                with self.sync.micro_step(last):
                    with self.autocast():
                        _, loss = self.model(x, y)  # mean over this micro-batch's b·T tokens
                    # /A: summed over micro-steps, then averaged over W ranks by the sync, the
                    # gradient is that of the mean loss over the global batch (T targets each).
                    scaled = loss / self.accum
                    (self.scaler.scale(scaled) if self.scaler else scaled).backward()
                loss_sum += loss.detach()
            self.sync.finish()
            if self.scaler is not None:
                self.scaler.unscale_(self.optimizer)
            # After the sync every rank holds the same gradients, so this is the global norm.
            norm = self.sync.clip(self.cfg.optim.grad_clip or float("inf"))
        return loss_sum / self.accum, norm

    def probe(self, batch: int) -> float:
        """The global mean loss of the weights as they are on global batch `batch` (no update,
        no gradient, no RNG drawn): each rank its share, one all-reduce. Collective."""
        with dist.collective() if self.env.world_size > 1 else contextlib.nullcontext():
            return evaluate(self.raw, self.loader.batch(batch), self.env, self.autocast)

    def update(self, lr: float) -> None:
        set_lr(self.optimizer, lr, momentum_at(self.step, self.cfg.optim))
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

def _due(step: int, every: int, last: int) -> bool:
    return step == last or (every > 0 and step % every == 0)


def loop(trainer: Trainer, metrics: Metrics, run_dir: RunDir, saver: Saver) -> Verdict | None:
    """Trains to run.steps; returns early with the rollback verdict of a spike, if one comes."""
    cfg, env, total, guard = trainer.cfg, trainer.env, trainer.cfg.run.steps, trainer.guard
    while trainer.step < total:
        trainer.doing = f"step {trainer.step + 1}"
        lr = lr_at(trainer.step, cfg.optim, total) * guard.spikes.lr_factor
        loss, norm = trainer.train_step()
        health = guard.exchange(loss, norm, scaled=trainer.scaler is not None,
                                saving=saver.busy)
        if health.saved or health.bad:  # every rank's save is done, or a stop must name one
            settle(trainer, saver, run_dir)
        verdict = guard.judge(trainer.step + 1, health, trainer.batch, trainer.probe)
        if verdict.action == "rollback":
            settle(trainer, saver, run_dir)  # a rollback reads the newest complete checkpoint
            return verdict
        if verdict.event:
            metrics.log_event(trainer.step + 1, verdict.event, **_spike_fields(verdict),
                              **verdict.fields)
            metrics.write(f"ddpgpt: warning: {verdict.line}")
        if verdict.action == "skip":
            trainer.skip_update()
        else:
            trainer.update(lr)
        trainer.step += 1
        if _due(trainer.step, cfg.run.log_every, total):
            metrics.log_step(trainer.step, None if health.bad else health.loss, lr,
                             None if health.bad else norm.item(), trainer.elapsed_s)
        with metrics.paused():
            if _due(trainer.step, cfg.run.eval_every, total):
                trainer.doing = f"the evaluation after step {trainer.step}"
                val_loss = evaluate(trainer.raw, trainer.val, env, trainer.autocast)
                metrics.log_eval(trainer.step, val_loss,
                                 trainer.dataset.bits_per_byte(val_loss))
            if _due(trainer.step, cfg.run.checkpoint_every, total) or health.stop:
                trainer.doing = f"the checkpoint of step {trainer.step}"
                # A stop, and the end, wait until the checkpoint is published.
                save(trainer, saver, run_dir, "stop" if health.stop else "scheduled",
                     wait=health.stop or trainer.step == total)
        if health.stop and trainer.step < total:
            guard.settle_stop()
            nodes = dist.elastic_nodes()
            hint = resume_hint(cfg.run.resume, str(run_dir), bool(nodes and nodes[1] > nodes[0]))
            raise preempted(trainer.step, guard.signal.name,
                            checkpoint.step_dir(run_dir.checkpoints, trainer.step), hint,
                            quiet=not env.is_main)
    return None


# ---- a run, from its config to its end -----------------------------------------------------------

def setup(cfg: TrainConfig, env: dist.DistEnv, dataset: TokenDataset, start: resume.Start,
          guard: Guard, announce: bool = True) -> Trainer:
    init = None
    if start.path is None and cfg.model.init_from:  # a fresh start; restarts resume instead
        from ddpgpt.init_from import read_state
        # Every rank reads the weights itself; one that cannot stops them all.
        init = dist.together(env, lambda: read_state(cfg.model.init_from, cfg.model))
    trainer = Trainer(cfg, env, dataset, guard, init=init, digest=start.path is None)
    trainer.origin = start.origin

    def restore() -> None:
        if start.path is not None:
            trainer.restore(start.path, start.meta, start.data_switch)

    dist.together(env, restore)  # every rank calls it: ranks may disagree on the start (see agree)
    if start.path is not None and env.is_main and announce:
        print(f"resuming from {start.path} (step {trainer.step}, saved at world size "
              f"{start.meta['world_size']})", file=sys.stderr)
    # From scratch: what each rank built; resumed: the weights loaded (whole: fsdp2 gathers).
    weights = (trainer.init_digest if start.path is None
               else dist.state_digest(trainer.sync.model_state()))
    # Every rank holds the same checkpoint, weights, config, data and code, or all stop together.
    # Causes before their effects: a differing checkpoint or config explains the weights.
    dist.agree(env, {
        "the checkpoint to resume from": (dist.digest(str(trainer.step)),
                                          "put the run dir on a filesystem that every node shares"),
        "the resolved config": (dist.digest(json.dumps(shared(cfg), sort_keys=True)),
                                "start every rank with the same command line and config file"),
        "the dataset (meta.json)": (bytes.fromhex(dataset.fingerprint),
                                    "every node must see the same prepared dataset in data.dir"),
        "the ddpgpt and torch versions": (dist.digest(__version__, torch.__version__),
                                          "install the same versions on every node"),
        "the parameters before training": (weights, (
            f"every rank must read the same --init-from {cfg.model.init_from} (put it on a "
            "filesystem every node shares)" if cfg.model.init_from and start.path is None else
            "every rank must build the model from the same seed (run.seed); do not seed ranks "
            "differently before init")),
    })
    return trainer


def run(cfg: TrainConfig) -> None:
    """Trains in this process: alone, as a torchrun worker, or as a `--nproc` worker."""
    # 1. Everything that needs no process group: batch arithmetic, the data, every `auto`.
    here = dist.detect()
    try:
        cfg, dataset = preflight(cfg, here.world_size, here.local_world_size, dist.elastic_nodes())
    except UserError as e:  # every rank finds it: one line per node
        e.quiet = e.quiet or here.local_rank > 0
        raise
    run_dir = RunDir(cfg.run.dir)
    run_dir.check_creatable()
    if here.world_size == 1 and not dist.under_launcher():  # one process: finished already?
        first = resume.choose(cfg, run_dir, True, dataset.fingerprint, verify=False,
                              tokenizer=dataset.tokenizer_fingerprint)
        if resume.finished(resume.settle(cfg, first), first):
            with run_dir.locked():  # another run training here is refused, as always
                print(resume.finished_message(run_dir, first.step, cfg.run.steps),
                      file=sys.stderr)
            return
    # 2. Join the group (W > 1); it is destroyed on every way out of this block.
    with dist.session(cfg.run.device, cfg.run.backend, cfg.run.dist_timeout_s) as env, \
            StopSignal(env.is_main) as stop:
        configure(cfg.run.threads, env.device)
        if cfg.data.verify:  # each rank re-hashes a 1/W share of the shards
            dist.together(env, lambda: dataset.verify(part=env.rank, parts=env.world_size))
        start, env = elastic.claim(run_dir, cfg, env, dataset)
        cfg = resume.settle(cfg, start)
        lr_fields = "optim.lr or optim.muon_lr" if cfg.optim.name == "muon" else "optim.lr"
        guard = Guard(env, cfg.run, stop, lr_fields, run_dir.checkpoints)
        trainer = setup(cfg, env, dataset, start, guard)
        dist.together(env, lambda: write_run_files(run_dir, cfg, dataset, start.step),
                      main_only=True)
        metrics = open_metrics(trainer, run_dir, start)
        saver = Saver(env, run_dir.checkpoints, dist.checkpoint_group(env, cfg.run.dist_timeout_s),
                      saver_token(env), cfg.run.keep_checkpoints, cfg.run.checkpoint_async)
        try:
            try:
                _install_faults(trainer, saver)
                while (spike := loop(trainer, metrics, run_dir, saver)) is not None:  # 3. spike
                    trainer = roll_back(trainer, spike, run_dir, start, metrics, lambda at: setup(
                        cfg, env, dataset, at, guard, announce=False))  # built as on a restart
                    _install_faults(trainer, saver)
            except dist.CollectiveError as e:
                # A rank lost mid-save shows in the step's collectives first: name the save.
                doing = trainer.doing if saver.troubled is None else \
                    f"the checkpoint of step {saver.troubled}"
                raise collective_failed(e, env, doing, cfg.run.dist_timeout_s) from None
        except UserError as e:  # the stop's one line, also where a closed pipe cannot lose it
            with contextlib.suppress(UserError, OSError):
                metrics.log_event(trainer.step, "stop", label=e.label, message=str(e),
                                  exit_code=e.exit_code)
            raise
        finally:
            saver.close()  # the save in flight, if any, finishes (or fails) first
            metrics.close()
            trainer.close()
            run_dir.unlock()


def roll_back(trainer: Trainer, verdict: Verdict, run_dir: RunDir, origin: resume.Start,
              metrics: Metrics, build) -> Trainer:
    """The trainer that goes on after a spike the weights did not heal from: rebuilt by
    `build(start)` (setup: the same path as a restart) from the newest healthy checkpoint
    (spike.target), the loader moved past the batches read since, the lr lowered for the rest of
    the run. Collective: every rank decides the same and calls it."""
    cfg, guard, env, spike = trainer.cfg.run, trainer.guard, trainer.env, verdict.spike
    spikes = guard.spikes
    found = _healthy_start(run_dir, verdict.first, origin, spikes.rollbacks)
    read = trainer.loader.batch_index  # past the spike's batch: the cursor to skip to
    memory = spikes.rollbacks, spikes.lr_factor  # the run's, not the checkpoint's
    trainer.doing = f"the rollback after step {spike.step}"
    trainer.close()  # the old model and optimizer go before the new ones are built
    gc.collect()
    guard.load_state_dict(None)  # a start from scratch loads nothing into it
    new = build(found)
    spikes.rollbacks, spikes.lr_factor = memory
    # The batches from the checkpoint's cursor to the spike's: those of steps c+1..s, and any an
    # earlier rollback to the same checkpoint skipped on the way.
    batches = read - new.loader.batch_index
    skipped = new.loader.skip(batches)
    spikes.rolled_back(spike.step, found.step, batches)
    name = found.path.name if found.path else "the initial state"
    steps = f" (steps {found.step + 1}-{spike.step})" * (batches == spike.step - found.step)
    what = spike.describe(cfg.spike_ratio, len(spikes.losses))
    since = "" if verdict.first == spike.step else f" (the spike began at step {verdict.first})"
    metrics.write(f"ddpgpt: warning: step {spike.step}: {what}{since}; rolling back to step "
                  f"{found.step} ({name}), skipping the {batches} global batch"
                  f"{'es' if batches > 1 else ''} read after it{steps}, the lr × "
                  f"{spikes.lr_factor:g} from now on (rollback {spikes.recent(spike.step)} of at "
                  f"most {cfg.max_rollbacks} within {cfg.rollback_window} steps)")
    metrics.rewind(new.step)
    metrics.log_event(new.step, "rollback", **_spike_fields(verdict),
                      checkpoint=str(found.path) if found.path else None,
                      checkpoint_step=found.step, skipped_batches=batches,
                      skipped_windows=skipped, lr_factor=spikes.lr_factor,
                      rollbacks=len(spikes.rollbacks))
    dist.barrier(env)  # every rank has rolled back before any trains on
    return new


def _healthy_start(run_dir: RunDir, first: int, origin: resume.Start,
                   rollbacks: list[dict]) -> resume.Start:
    """The checkpoint to roll back to (spike.target) as a Start; `origin` (where this process
    started) when no checkpoint of this run qualifies. The starting checkpoint itself is
    `origin`, which knows a data switch."""
    dirs = dict(checkpoint.step_dirs(run_dir.checkpoints))
    while (step := target(sorted(dirs), first, origin.step, rollbacks)) is not None:
        if step == origin.step and origin.path:
            return origin
        try:
            meta = checkpoint.read_meta(dirs[step])
        except checkpoint.CheckpointError as e:
            warn(f"rollback: skipping checkpoint {dirs[step].name}: {e}")
            del dirs[step]
            continue
        return resume.Start(dirs[step], meta, origin=meta.get("origin"))
    return origin


def _spike_fields(verdict: Verdict) -> dict:
    spike = verdict.spike
    if spike is None:
        return {}
    return {"spike_step": spike.step, "spike_loss": json_number(spike.loss),
            "median": json_number(spike.median), "nonfinite_ranks": spike.ranks,
            **({"first_step": verdict.first} if verdict.first else {})}


def write_run_files(run_dir: RunDir, cfg: TrainConfig, dataset: TokenDataset, step: int) -> None:
    """config.json (and configs.jsonl), and the dataset's meta.json and tokenizer (so `sample`
    needs only the run dir)."""
    run_dir.write_config(cfg.to_dict(), step)
    run_dir.write_data_files(dataset.path, dataset.meta_bytes)


def open_metrics(trainer: Trainer, run_dir: RunDir, start: resume.Start) -> Metrics:
    cfg, env = trainer.cfg, trainer.env
    peak = peak_flops(env.device, matmul_dtype(cfg.run.precision))
    # Every rank measures at once; a host hiccup can halve one reading, so take the best.
    peak = dist.all_reduce(env, torch.tensor(peak, device=env.device), op="max").item()
    if env.is_main:
        print(summary(trainer), file=sys.stderr)
        if trainer.dataset.split_bytes is None:
            warn(trainer.dataset.bytes_advice())
        if cfg.run.on_spike == "recover" and not 0 < cfg.run.checkpoint_every < cfg.run.steps:
            print(f"ddpgpt: note: no checkpoint before step {cfg.run.steps} "
                  f"(run.checkpoint_every = {cfg.run.checkpoint_every}): a loss spike the model "
                  "does not heal from can only roll back to the start", file=sys.stderr)
        if trainer.step >= cfg.run.steps:
            print(resume.finished_message(run_dir, trainer.step, cfg.run.steps), file=sys.stderr)
    # Rank 0 alone talks to the tracker; a tracker that cannot start stops every rank.
    tracker = dist.together(env, lambda: trackers.open_tracker(
        cfg.run.tracker, run_dir.path, cfg.to_dict(), trainer.step, cfg.run.tracker_project),
        main_only=True)
    metrics = Metrics(env.is_main, run_dir.metrics, trainer.step, cfg.run.steps,
                      cfg.data.global_batch * cfg.seq_len, trainer.raw.flops_per_token(cfg.seq_len),
                      peak, env.world_size, tracker)
    if start.data_switch:
        metrics.log_event(trainer.step, "data_switch", checkpoint=str(start.path),
                          old=start.meta["data_fingerprint"], new=trainer.dataset.fingerprint,
                          data_dir=cfg.data.dir)
    changed = resume.changes(start.meta["config"], cfg) if start.meta else {}
    if changed:  # applied, not ignored: say so where the curves are read, and once here
        metrics.log_event(trainer.step, "config_change", checkpoint=str(start.path),
                          changes=changed)
        if env.is_main:
            print("ddpgpt: resuming with changed settings (applied from step "
                  f"{trainer.step}): " + ", ".join(f"{k} {a} -> {b}" for k, (a, b)
                                                   in changed.items()), file=sys.stderr)
    return metrics


def _install_faults(trainer: Trainer, saver: Saver) -> None:
    """Test-only fault injection (DDPGPT_FAULT), wrapped around the step and the saver from
    outside the loop."""
    if os.environ.get("DDPGPT_FAULT"):
        from ddpgpt.guard import faults
        faults.install(trainer, saver)


def summary(trainer: Trainer) -> str:
    """One line on what runs where: processes, nodes, batch arithmetic, model size."""
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


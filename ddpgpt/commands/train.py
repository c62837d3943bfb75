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
requests; see guard/health.py) -> the update -> log, evaluate, save.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys

import torch

from ddpgpt import __version__
from ddpgpt.checkpoint import store
from ddpgpt.checkpoint.saver import Saver
from ddpgpt.checkpoint.saver import token as saver_token
from ddpgpt.config.schema import RunConfig, TrainConfig
from ddpgpt.data.mixture import MixedDataset, packing_notes, taken_now
from ddpgpt.data.shards import TokenDataset
from ddpgpt.data.tokenizer import load_tokenizer
from ddpgpt.distributed import collectives
from ddpgpt.distributed.group import (
    CollectiveError,
    DistEnv,
    checkpoint_group,
    detect,
    elastic_nodes,
    session,
    under_launcher,
)
from ddpgpt.errors import UserError, say, warn
from ddpgpt.evals.scorer import Scorer
from ddpgpt.evals.tasks import for_run
from ddpgpt.guard.health import (
    Guard,
    StopSignal,
    Unhealthy,
    collective_failed,
    preempted,
    resume_hint,
    saving,
)
from ddpgpt.guard.spike import Verdict
from ddpgpt.optim.schedule import warmup_notes
from ddpgpt.run import changes, elastic, logs, resume, trackers
from ddpgpt.run.metrics import Metrics, peak_flops, summary
from ddpgpt.run.precision import configure
from ddpgpt.run.preflight import preflight, shared
from ddpgpt.run.rollback import apply_rollback, roll_back, spike_fields
from ddpgpt.run.run_dir import RunDir
from ddpgpt.run.samples import Sampler
from ddpgpt.run.verify import verify_data
from ddpgpt.trainer import Trainer


def _due(step: int, every: int, last: int) -> bool:
    return step == last or (every > 0 and step % every == 0)


def loop(trainer: Trainer, metrics: Metrics, run_dir: RunDir, saver: Saver,
         tasks: Scorer | None, sampler: Sampler | None = None) -> Verdict | None:
    """Trains to run.steps, or to the first evaluation at run.target_val_loss; returns early with
    the rollback verdict of a spike, if one comes."""
    cfg, env, total, guard = trainer.cfg, trainer.env, trainer.cfg.run.steps, trainer.guard
    saved_at = trainer.last_checkpoint  # the newest checkpoint taken: resumed from, or saved
    lease = run_dir.lease  # rank 0's of a checkpoint URL, renewed by a thread of its own
    while trainer.step < total:
        trainer.doing = f"step {trainer.step + 1}"
        rates = trainer.schedule.at(trainer.step)
        loss, norm = trainer.train_step()
        health = guard.exchange(loss, norm, scaled=trainer.scaler is not None, saving=saver.busy,
                                waits=(trainer.data_wait_s, trainer.ckpt_wait_s),
                                trouble=lease is not None and lease.failure is not None)
        trainer.ckpt_wait_s = 0.0
        metrics.waited(health.data_wait_s, health.ckpt_wait_s)
        if health.trouble:  # rank 0's lease could not be renewed: every rank stops with its line
            collectives.together(env, saving(trainer, saver, str(run_dir))(lease.check),
                                main_only=True)
        if health.saved or health.bad:  # every rank's save is done, or a stop must name one
            with trainer.timed("checkpoint"):
                settle(trainer, saver, run_dir)
        verdict = guard.judge(trainer.step + 1, health, trainer.batch, trainer.probe)
        if verdict.action == "rollback":
            settle(trainer, saver, run_dir)  # a rollback reads the newest complete checkpoint
            return verdict
        if verdict.spike is None and saved_at == trainer.step:  # healthy after a checkpoint
            guard.spikes.confirm(saved_at)
        if verdict.event:
            metrics.log_event(trainer.step + 1, verdict.event, **spike_fields(verdict),
                              **verdict.fields)
            metrics.write(f"ddpgpt: warning: {verdict.line}")
        if verdict.action == "skip":
            trainer.skip_update()
        else:
            trainer.update(rates)
        trainer.step += 1
        if _due(trainer.step, cfg.run.log_every, total):
            metrics.log_step(trainer.step, None if health.bad else health.loss, rates.lr,
                             None if health.bad else norm.item(), trainer.elapsed_s,
                             taken_now(trainer.loader))
        reached = False
        with metrics.paused():
            if sampler is not None and sampler.due(trainer.step):
                trainer.doing = f"the sample after step {trainer.step}"
                sampler(trainer, metrics.write)
            if _due(trainer.step, cfg.run.eval_every, total):
                trainer.doing = f"the evaluation after step {trainer.step}"
                final = trainer.step == total
                if final:  # the bar's time per step is the training's; the evaluation's own bar
                    metrics.finish_bar()
                # val loss, the tasks' scores, the seconds so far
                row = trainer.evaluate(tasks, progress=final and env.is_main)
                metrics.log_eval(trainer.step, **row)
                guard.spikes.evaluated(trainer.step, row["val_loss"])  # for the end's verdict
                reached = 0 < row["val_loss"] <= cfg.run.target_val_loss
            if _due(trainer.step, cfg.run.checkpoint_every, total) or health.stop or reached:
                trainer.doing = f"the checkpoint of step {trainer.step}"
                # A stop, the target and the end wait until the checkpoint is published.
                with trainer.timed("checkpoint"):
                    save(trainer, saver, run_dir, "stop" if health.stop else "scheduled",
                         wait=health.stop or reached or trainer.step == total)
                saved_at = trainer.step
        if reached:  # time to target: its checkpoint is published; the run ends here
            metrics.log_target(trainer.step, row, cfg.run.target_val_loss)
            return None
        if health.stop and trainer.step < total:
            guard.settle_stop()
            nodes = elastic_nodes()
            hint = resume_hint(cfg.run.resume, str(run_dir), bool(nodes and nodes[1] > nodes[0]))
            raise preempted(trainer.step, guard.signal.name,
                            store.step_dir(run_dir.checkpoints, trainer.step), hint,
                            quiet=not env.is_main)
    return None


# ---- a run, from its config to its end -----------------------------------------------------------

def setup(cfg: TrainConfig, env: DistEnv, dataset: TokenDataset, start: resume.Start,
          guard: Guard, announce: bool = True) -> Trainer:
    init = None
    if start.path is None and cfg.model.init_from:  # a fresh start; restarts resume instead
        from ddpgpt.run.init_weights import grown, loaded, read_state
        spec, vocab = cfg.model.init_from, dataset.vocab_size
        # Every rank reads the weights itself; one that cannot stops them all.
        init = collectives.together(env, lambda: read_state(spec, cfg.model, vocab))
        if env.is_main and announce:  # (and the vocabulary grown by the chat template's tokens)
            print("\n".join(filter(None, [loaded(spec, init), grown(spec, cfg.model, vocab)])),
                  file=sys.stderr)
    trainer = Trainer(cfg, env, dataset, guard, init=init, digest=start.path is None)
    trainer.origin = start.origin

    def restore() -> None:
        if start.path is not None:
            trainer.restore(start.path, start.meta, start.data_switch)

    # Every rank calls it: ranks may disagree on the start (see agree).
    collectives.together(env, restore)
    if start.path is not None and env.is_main and announce:
        say(f"resuming from {start.path} (step {trainer.step}, saved at world size "
            f"{start.meta['world_size']})")
    if start.rollback is not None:  # a rollback decided, and stopped before a checkpoint had it
        batches, _ = apply_rollback(trainer, start.rollback)
        if env.is_main:
            say(f"ddpgpt: going on with the rollback after step {start.rollback['spike_step']} "
                f"to step {trainer.step}: skipping the {batches} global batches read after it, "
                f"the lr × {guard.spikes.lr_factor:g} from now on")
    # From scratch: what each rank built; resumed: the weights loaded (whole: fsdp2 gathers).
    weights = (trainer.init_digest if start.path is None
               else collectives.state_digest(trainer.sync.model_state()))
    # Every rank holds the same checkpoint, weights, config, data and code, or all stop together.
    # Causes before their effects: a differing checkpoint or config explains the weights.
    collectives.agree(env, {
        "the checkpoint to resume from": (collectives.digest(str(trainer.step)),
                                          "put the run dir on a filesystem that every node shares"),
        "the resolved config": (collectives.digest(json.dumps(shared(cfg), sort_keys=True)),
                                "start every rank with the same command line and config file"),
        "the dataset (meta.json)": (bytes.fromhex(dataset.fingerprint),
                                    "every node must see the same prepared dataset in data.dir"),
        "the ddpgpt and torch versions": (collectives.digest(__version__, torch.__version__),
                                          "install the same versions on every node"),
        "the parameters before training": (weights, (
            f"every rank must read the same --init-from {cfg.model.init_from} (put it on a "
            "filesystem every node shares)" if cfg.model.init_from and start.path is None else
            "every rank must build the model from the same seed (run.seed); do not seed ranks "
            "differently before init")),
    })
    return trainer


def run(cfg: TrainConfig, note: str = "") -> None:
    """Trains in this process: alone, as a torchrun worker, or as a `--nproc` worker. `note`:
    lines on what the command line made of the config, said by rank 0 once it checked out."""
    # 1. Everything that needs no process group: batch arithmetic, the data, every `auto`.
    here = detect()
    try:
        cfg, dataset = preflight(cfg, here.world_size, here.local_world_size, elastic_nodes())
        tasks = for_run(cfg.run)  # a bad task file, or HellaSwag offline: one line
    except UserError as e:  # every rank finds it: one line per node
        e.quiet = e.quiet or here.local_rank > 0
        raise
    run_dir = RunDir(cfg.run.dir, cfg.run.checkpoint_url)
    run_dir.check_creatable()
    planned = None  # where the run starts: decided once, here for one process, else in claim
    if here.world_size == 1 and not under_launcher():  # one process: finished already?
        planned = settled, first = resume.plan(cfg, run_dir, dataset, verify=True)
        if resume.report_finished(settled, run_dir, first):
            return
    # 2. Join the group (W > 1); it is destroyed on every way out of this block.
    with session(cfg.run.device, cfg.run.backend, cfg.run.dist_timeout_s) as env, \
            StopSignal(env.is_main) as stop:
        configure(cfg.run.threads, env.device)
        if cfg.data.verify:  # headers and sizes were checked at open; hashes once per file
            verify_data(env, dataset)
        cfg, start, env = elastic.claim(run_dir, cfg, env, dataset, planned)
        if note and env.is_main:  # the run dir is this job's: no other line can come first
            say(note)
        # Each rank's share of the tasks, rendered once.
        scorer = collectives.together(env, lambda: Scorer(
            tasks, load_tokenizer(dataset.path, dataset.tokenizer), cfg.model.block_size, env)
        ) if tasks else None
        lr_fields = "optim.lr or optim.muon_lr" if cfg.optim.name == "muon" else "optim.lr"
        guard = Guard(env, cfg.run, stop, lr_fields, run_dir.checkpoints, dataset.vocab_size)
        trainer = setup(cfg, env, dataset, start, guard)
        collectives.together(env, lambda: write_run_files(run_dir, cfg, dataset, start.step,
                                                          env.world_size), main_only=True)
        metrics = open_metrics(trainer, run_dir, start)
        sampler = Sampler(cfg, env, dataset) if cfg.run.sample_every else None
        saver = Saver(env, run_dir.checkpoints, checkpoint_group(env, cfg.run.dist_timeout_s),
                      saver_token(env), cfg.run.keep_checkpoints, cfg.run.checkpoint_async)
        ended = None  # the verdict of a run that trained to its end but is not healthy
        try:
            try:
                _install_faults(trainer, saver)
                if cfg.run.eval_at_start and trainer.step == 0:
                    evaluate_first(trainer, metrics, scorer)
                # 3. Train; a spike the weights do not heal from rolls back and goes on.
                while (spike := loop(trainer, metrics, run_dir, saver, scorer, sampler)) \
                        is not None:
                    trainer = roll_back(trainer, spike, run_dir, start, metrics, lambda at: setup(
                        cfg, env, dataset, at, guard, announce=False))  # built as on a restart
                    _install_faults(trainer, saver)
                # 4. The end: healthy, or said loudly (an event, one line, exit 3); the steps
                # that skipped their update either way.
                if (ended := guard.end(trainer.step)) is not None:
                    metrics.log_event(trainer.step, ended.event, **ended.fields)
                elif skipped := guard.skipped_steps(trainer.step):
                    metrics.write(f"ddpgpt: note: {skipped}")
            except CollectiveError as e:
                # A rank lost mid-save shows in the step's collectives first: name the save.
                doing = trainer.doing if saver.troubled is None else \
                    f"the checkpoint of step {saver.troubled}"
                raise collective_failed(e, env, doing, cfg.run.dist_timeout_s) from None
            except UserError:  # object storage failing in a step (its data): as in a save
                with saving(trainer, saver, str(run_dir)):
                    raise
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
        if ended is not None:
            raise Unhealthy(ended.line, quiet=not env.is_main)
        if env.is_main:  # trained to the end (a stop raised above): below the closed bar
            print(run_dir.next_commands(), file=sys.stderr)


def evaluate_first(trainer: Trainer, metrics: Metrics, tasks: Scorer | None) -> None:
    """run.eval_at_start: the evaluation before any step (step 0), the loss the first steps
    start from (--init-from's weights on this data)."""
    trainer.doing = "the evaluation before step 1"
    with metrics.paused():
        metrics.log_eval(0, **trainer.evaluate(tasks))


def save(trainer, saver: Saver, run_dir: RunDir, reason: str, wait: bool) -> None:
    """A checkpoint of every rank's state, each rank writing its own share (checkpoint/saver.py);
    in the background unless `wait` (or run.checkpoint_async is off). Every rank calls it at
    once."""
    cfg, ds = trainer.cfg, trainer.dataset
    held, replicated, rest = trainer.shard_state()
    spikes = trainer.guard.spikes
    # rollbacks: which recorded rollback this checkpoint has applied (checkpoint.record_rollback);
    # healthy_checkpoint: the rollback target keep-last-k must not delete; unhealthy: the end's
    # verdict on the last step's (a rerun of the finished run says it again: resume.py).
    ended = trainer.guard.end(trainer.step) if trainer.step >= cfg.run.steps else None
    meta = {"config": cfg.to_dict(), "reason": reason, "data_fingerprint": ds.fingerprint,
            "tokenizer_fingerprint": ds.tokenizer_fingerprint, "origin": trainer.origin,
            "rollbacks": len(spikes.rollbacks), "healthy_checkpoint": spikes.newest_healthy,
            "unhealthy": ended.line if ended else None}
    settle(trainer, saver, run_dir)  # the save in flight first: its failure comes before ours
    if run_dir.remote:  # the lease still ours (rank 0 checks) and the logs there, first
        collectives.together(trainer.env, saving(trainer, saver, str(run_dir))(
            lambda: logs.before_checkpoint(run_dir)), main_only=True)  # its line, then together
    with saving(trainer, saver, str(run_dir)):
        saver.save(trainer.step, held, replicated, rest, meta, wait)


def settle(trainer, saver: Saver, run_dir: RunDir) -> None:
    """Every rank, at the same step: waits for the save in flight and learns how it went."""
    if saver.pending:
        trainer.doing, doing = f"the checkpoint of step {saver.pending[0]}", trainer.doing
        with saving(trainer, saver, str(run_dir)):
            saver.settle()
        trainer.doing = doing


def write_run_files(run_dir: RunDir, cfg: TrainConfig, dataset: TokenDataset | MixedDataset,
                    step: int, world_size: int) -> None:
    """config.json (and configs.jsonl), and the dataset's meta.json and tokenizer (so `sample`
    needs only the run dir); a mixture's: its first dataset's (they share the tokenizer) and
    data_sources.json, each source's dir, weight and fingerprint."""
    run_dir.write_config(cfg.to_dict(), step, world_size)
    run_dir.write_data_files(dataset.path, dataset.meta_bytes,
                             dataset.sources() if isinstance(dataset, MixedDataset) else None)


def open_metrics(trainer: Trainer, run_dir: RunDir, start: resume.Start) -> Metrics:
    cfg, env = trainer.cfg, trainer.env
    peak = peak_flops(env.device, trainer.precision.matmul_dtype)
    # Every rank measures at once; a host hiccup can halve one reading, so take the best.
    peak = collectives.all_reduce(env, torch.tensor(peak, device=env.device), op="max").item()
    if env.is_main:
        print(summary(trainer), file=sys.stderr)
        if trainer.dataset.split_bytes is None:
            warn(trainer.dataset.bytes_advice())
        warnings, notes = packing_notes(trainer.loader)  # one document; conversations
        for note in warnings + warmup_notes(cfg.optim, cfg.run.steps):
            warn(note)
        for note in notes:
            say(f"ddpgpt: {note}")
        if trainer.first_step_waits():
            print(trainer.first_step_waits(), file=sys.stderr)
        # Worth saying only for a run longer than the default checkpoint period: a shorter
        # one loses no more than the defaults accept.
        if (cfg.run.on_spike == "recover" and not 0 < cfg.run.checkpoint_every < cfg.run.steps
                and cfg.run.steps > RunConfig.checkpoint_every):
            print(f"ddpgpt: note: no checkpoint before step {cfg.run.steps} "
                  f"(run.checkpoint_every = {cfg.run.checkpoint_every}): a loss spike the model "
                  "does not heal from can only roll back to the start", file=sys.stderr)
        if trainer.step >= cfg.run.steps:
            print(resume.finished_message(run_dir, trainer.step, cfg.run.steps), file=sys.stderr)
    # Rank 0 alone talks to the tracker; a tracker that cannot start stops every rank.
    tracker = collectives.together(env, lambda: trackers.open_tracker(
        cfg.run.tracker, run_dir.path, cfg.to_dict(), trainer.step, cfg.run.tracker_project),
        main_only=True)
    metrics = Metrics(env.is_main, run_dir.metrics, trainer.step, cfg.run.steps,
                      cfg.data.global_batch * cfg.seq_len, trainer.raw.flops_per_token(cfg.seq_len),
                      peak, env.world_size, tracker)
    if start.data_switch:
        metrics.log_event(trainer.step, "data_switch", checkpoint=str(start.path),
                          old=start.meta["data_fingerprint"], new=trainer.dataset.fingerprint,
                          data_dir=cfg.data.dir)
    metrics.taken_mark = taken_now(trainer.loader)
    mix = getattr(trainer.loader, "changed", None)
    if mix:  # resumed with other weights: the rows from here follow them (data/mixture.py)
        metrics.log_event(trainer.step, "mixture_change", checkpoint=str(start.path), **mix)
        metrics.write(f"ddpgpt: the mixture changed on resume (applied from step {trainer.step}): "
                      + ", ".join(f"{n} {mix['old'][n]:g} -> {mix['new'][n]:g}"
                                  for n in mix["new"]))
    changed = changes.changes(start.meta["config"], cfg) if start.meta else {}
    if changed:  # applied, not ignored: say so where the curves are read, and once here
        metrics.log_event(trainer.step, "config_change", checkpoint=str(start.path),
                          changes=changed)
        metrics.write("ddpgpt: resuming with changed settings (applied from step "
                      f"{trainer.step}): " + ", ".join(f"{k} {a} -> {b}" for k, (a, b)
                                                       in changed.items())
                      + changes.lr_note(cfg, trainer.step, trainer.guard.spikes.lr_factor, changed)
                      + changes.data_note(cfg, trainer.other_data))
    return metrics


def _install_faults(trainer: Trainer, saver: Saver) -> None:
    """Test-only fault injection (DDPGPT_FAULT), wrapped around the step and the saver from
    outside the loop."""
    if os.environ.get("DDPGPT_FAULT"):
        from ddpgpt.guard import faults
        faults.install(trainer, saver)

"""Fault injection for the reliability tests; a real run never sets DDPGPT_FAULT.

    DDPGPT_FAULT="ACTION@STEP" or "ACTION@STEP@RANK" (rank 0 by default), or several of them
    separated by commas

makes that rank do ACTION when STEP steps are complete and the next one is about to start, on the
job's first start only (never after an elastic restart, so a restarted job can finish):

    kill         SIGKILL itself: a crash (OOM killer)
    kill-node    SIGKILL its launcher (torchrun's agent), then itself: a node lost whole
    term         SIGTERM itself: a pre-emption
    term2        SIGTERM itself, then again after the duplicate window: the second must exit at once
    parent:SIG   send SIG (INT, HUP, QUIT, TERM, KILL) to its parent, the launcher
    stall        stop responding (sleeps): a hung rank
    hold         wait (at most HOLD_S) until a stop signal reaches it, then go on: a membership
                 change (the agent's SIGTERM) that arrives between steps STEP and STEP+1
    nan          its loss for that step becomes NaN
    spike        its loss on global batch STEP (the one a straight run's step STEP+1 reads) is
                 multiplied by 1000: bad data. A rollback skips that batch, so it comes once
    diverge      its loss is multiplied by 1000 every time step STEP+1 runs: a spike that
                 skipping data does not cure
    garbage      its windows of global batch STEP are replaced by uniformly random tokens (drawn
                 from a generator seeded by STEP): bad data whose loss and gradient are real
    weights      from step STEP+1 on, its losses are multiplied by 1000, the spike probe's too:
                 weights that look broken on every batch and do not heal, until the run rolls
                 back (then the fault is spent)
    weights-always   the same every time the run is at step STEP+1 or later, rollbacks or not

An action written `rolled:ACTION` (e.g. `rolled:kill@3`) is due only once the run has rolled back
after a loss spike: at step STEP of the history the rollback goes on with (a kill or a stop right
after "rolling back to step 3" is `rolled:kill@3` or `rolled:term@4`).

The actions above wait for the checkpoint this rank may be writing in the background (a crash
between checkpoints). These happen around the checkpoint of step STEP (checkpoint/saver.py):

    kill-saving      SIGKILL itself as the checkpoint is taken, before its save starts
    kill-writing     SIGKILL itself in the middle of the write of its share (in the background)
    kill-committing  SIGKILL itself in the commit: rank 0 once meta.json is in the temporary
                     directory, before the rename; another rank once its files are hashed
    hold-save        the write waits, in its thread, until the training waits for it (the next
                     save, a stop or the end): the next save must wait
    term-saving      SIGTERM itself during the write, which then holds as hold-save does: a stop
                     requested while a save is in flight

`install` wraps the trainer's step and the saver's pieces from the outside; the training loop
knows nothing of this.
"""

from __future__ import annotations

import os
import signal
import time
from concurrent import futures

import torch

from ddpgpt.checkpoint import sharded, store
from ddpgpt.guard.health import GRACE_S

SAVING = ("kill-saving", "kill-writing", "kill-committing", "hold-save", "term-saving")
ACTIONS = ("kill", "kill-node", "term", "term2", "stall", "hold", "nan", "spike", "diverge",
           "garbage", "weights", "weights-always", *SAVING)
LOSS_ACTIONS = {"nan": float("nan"), "spike": 1000.0, "diverge": 1000.0}
HOLD_S = 300  # the longest a hold waits (a test that never releases it fails, not hangs)


def parse(spec: str, rank: int) -> tuple[str, int] | None:
    """(action, step) for this rank, or None. A `rolled:` prefix stays on the action."""
    action, step, *who = spec.split("@")
    bare = action.removeprefix("rolled:")
    if bare not in ACTIONS and not bare.startswith("parent:"):
        raise ValueError(f"DDPGPT_FAULT: unknown action {action!r}; one of "
                         f"{', '.join(ACTIONS)}, parent:SIG")
    return (action, int(step)) if int(who[0] if who else 0) == rank else None


def act(action: str, step: int) -> None:
    print(f"fault: {action} at step {step} ({time.time():.3f})", flush=True)
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "kill-node":
        os.kill(os.getppid(), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)
    elif action in ("term", "term2"):
        os.kill(os.getpid(), signal.SIGTERM)
        if action == "term2":
            time.sleep(GRACE_S + 0.5)
            os.kill(os.getpid(), signal.SIGTERM)
    elif action.startswith("parent:"):
        os.kill(os.getppid(), getattr(signal, "SIG" + action.split(":")[1]))
    elif action == "stall":
        while True:
            time.sleep(3600)


def hold(stop) -> None:
    """Waits until `stop` (a StopSignal) has caught a signal."""
    print(f"fault: hold until a stop signal ({time.time():.3f})", flush=True)
    deadline = time.monotonic() + HOLD_S
    while not stop.requested and time.monotonic() < deadline:
        time.sleep(0.02)


def install(trainer, saver) -> None:
    """Wraps the trainer's step (and the saver's pieces) with the faults DDPGPT_FAULT names for
    this rank, if any."""
    if not trainer.env.first_start:
        return
    for spec in os.environ["DDPGPT_FAULT"].split(","):
        fault = parse(spec, trainer.env.rank)
        if fault is not None and fault[0] in SAVING:
            _around_saving(*fault, trainer, saver)
        elif fault is not None and fault[0] == "garbage":
            _garbage(fault[1], trainer)
        elif fault is not None and fault[0].startswith("weights"):
            _broken_weights(*fault, trainer)
        elif fault is not None:
            _around_step(*fault, trainer, saver)


def _around_step(action: str, at: int, trainer, saver) -> None:
    step = trainer.train_step
    rolled = action.startswith("rolled:")  # due only after a rollback
    action = action.removeprefix("rolled:")

    def faulty_step():
        due = (trainer.loader.batch_index if action == "spike" else trainer.step) == at \
            and (not rolled or bool(trainer.guard.spikes.rollbacks))
        if due and saver.pending:  # between checkpoints: the one in flight is written first
            futures.wait([saver.pending[1]])
        if due and action == "hold":
            hold(trainer.guard.signal)
        elif due and action not in LOSS_ACTIONS:
            act(action, at)
        loss, norm = step()
        if due and action in LOSS_ACTIONS:
            print(f"fault: {action} at step {trainer.step + 1}", flush=True)
            loss = loss * LOSS_ACTIONS[action]
        return loss, norm

    trainer.train_step = faulty_step


def _garbage(at: int, trainer) -> None:
    """Global batch `at`, as this rank reads it, becomes random tokens."""
    loader = trainer.loader
    next_step = loader.next_step

    def garbage_step():
        due = loader.batch_index == at
        batches = next_step()
        if not due:
            return batches
        print(f"fault: garbage in global batch {at}", flush=True)
        gen = torch.Generator().manual_seed(at)
        vocab = trainer.dataset.vocab_size
        return ((torch.randint(vocab, x.shape, generator=gen).to(x.device),
                 torch.randint(vocab, y.shape, generator=gen).to(y.device)) for x, y in batches)

    loader.next_step = garbage_step


def _broken_weights(action: str, at: int, trainer) -> None:
    step, probe = trainer.train_step, trainer.probe

    def broken() -> bool:
        return trainer.step >= at and (action == "weights-always"
                                       or not trainer.guard.spikes.rollbacks)

    def broken_step():
        loss, norm = step()
        return (loss * 1000, norm) if broken() else (loss, norm)

    def broken_probe(batch: int) -> float:
        """This rank's share of the probe's loss is scaled before the probe's all-reduce, as in
        the step: every rank then sees the same global value (scaling the reduced value on one
        rank alone would make the ranks disagree on the verdict)."""
        if not broken():
            return probe(batch)
        model = trainer.raw
        forward = model.forward

        def scaled(*args, **kwargs):
            logits, loss = forward(*args, **kwargs)
            return logits, loss * 1000

        model.forward = scaled
        try:
            return probe(batch)
        finally:
            del model.forward  # the class's forward again

    trainer.train_step, trainer.probe = broken_step, broken_probe


def _around_saving(action: str, at: int, trainer, saver) -> None:
    name = store.step_dir(saver.root, at).name
    if action == "kill-saving":
        shard_state = trainer.shard_state

        def dying_shard_state():
            if trainer.step == at:
                act("kill", at)
            return shard_state()

        trainer.shard_state = dying_shard_state
    elif action == "kill-committing" and trainer.env.is_main:
        publish = store._publish

        def dying_publish(tmp, final):
            if final.name == name:
                act("kill", at)
            publish(tmp, final)

        store._publish = dying_publish
    elif action == "kill-committing":
        hash_files = store.hash_files

        def dying_hash(directory, names):
            hashes = hash_files(directory, names)
            if name in directory.name:
                act("kill", at)
            return hashes

        store.hash_files = dying_hash
    else:
        _around_write(action, at, name, trainer, saver)


def _around_write(action: str, at: int, name: str, trainer, saver) -> None:
    """In the write of this rank's share (DCP's writer, in the background thread)."""
    write_data = sharded.Writer.write_data

    def faulty_write(self, plan, planner):
        if name in str(self.path):
            if action == "kill-writing":
                act("kill", at)
            if action == "term-saving":
                act("term", at)
            print(f"fault: {action} holds the write of step {at}", flush=True)
            if saver.waiting.wait(HOLD_S):
                print(f"fault: released the write of step {at} at step {trainer.step}",
                      flush=True)
        return write_data(self, plan, planner)

    sharded.Writer.write_data = faulty_write

"""What the step loop waits for, in metrics.jsonl: data_wait_s (blocked on the step's batch)
and ckpt_wait_s (blocked on checkpoints), the max over ranks through the health exchange,
averaged over the steps since the previous row; the step line's word on the data wait. Lower
bounds only on wall time: a loaded machine makes every wait longer, never shorter."""

from __future__ import annotations

import io
import json
import sys
import time

import pytest
import torch

from ddpgpt.cli import main
from ddpgpt.data.loader import TrainLoader
from ddpgpt.run.metrics import Metrics, data_share
from tests.helpers import tiny_train_args
from tests.unit.test_trainer import make

SLEEP = 0.05  # seconds each micro-batch's read is made to take


def sleepy(monkeypatch) -> None:
    """Every TrainLoader's micro-batches, each read SLEEP seconds late."""
    real = TrainLoader._micro_batches

    def slow(self, step):
        for batch in real(self, step):
            time.sleep(SLEEP)
            yield batch

    monkeypatch.setattr(TrainLoader, "_micro_batches", slow)


def test_a_step_waits_at_least_as_long_as_its_loader_sleeps(tiny_data, tmp_path, one_thread,
                                                            monkeypatch):
    """A = 2 micro-batches of SLEEP each: the step's data wait holds both, the exchange carries
    it (W = 1: its own), and the loss is the one a loader that does not sleep gives."""
    plain = make(tiny_data, tmp_path)
    want, _ = plain.train_step()
    sleepy(monkeypatch)
    trainer = make(tiny_data, tmp_path)
    loss, norm = trainer.train_step()
    assert trainer.accum == 2 and trainer.data_wait_s >= 2 * SLEEP
    assert torch.equal(loss, want)
    with trainer.timed("checkpoint"):  # a save's part in the loop
        time.sleep(SLEEP)
    assert trainer.ckpt_wait_s >= SLEEP and trainer.checkpoint_s >= SLEEP
    health = trainer.guard.exchange(loss, norm, scaled=False,
                                    waits=(trainer.data_wait_s, trainer.ckpt_wait_s))
    assert health.data_wait_s == pytest.approx(trainer.data_wait_s, rel=1e-6)
    assert health.ckpt_wait_s == pytest.approx(trainer.ckpt_wait_s, rel=1e-6)
    trainer.data_wait_s = 1e9
    trainer.train_step()  # each step's wait is its own
    assert 2 * SLEEP <= trainer.data_wait_s < 1e9


def test_a_runs_rows_hold_its_waits(tiny_data, tmp_path, monkeypatch):
    """A whole run (the loop, the exchange, the rows): each row's data_wait_s, a mean per step,
    is at least the A sleeps of a step; every row has ckpt_wait_s."""
    sleepy(monkeypatch)
    args = tiny_train_args(tiny_data, tmp_path / "run", 4, run__log_every=2)[3:]
    main(["train", *args])
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text()
            .splitlines()]
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == [2, 4]
    assert all(r["data_wait_s"] >= 4 * SLEEP for r in steps), steps  # A = 4
    assert all(r["ckpt_wait_s"] >= 0 for r in steps)


def test_rows_average_the_waits_since_the_previous_row(tmp_path, monkeypatch):
    clock = iter([0.0, 2.0, 3.0])
    monkeypatch.setattr("ddpgpt.run.metrics.time.perf_counter", lambda: next(clock))
    metrics = Metrics(False, tmp_path / "metrics.jsonl", 0, 3, 1000, 6.0, peak=1e9,
                      world_size=1)
    metrics.waited(0.2, 0.0)
    metrics.waited(0.4, 3.0)  # a checkpoint's stall
    first = metrics.log_step(2, 1.0, 1e-3, 1.0, 2.0)
    second = metrics.log_step(3, 1.0, 1e-3, 1.0, 3.0)
    assert (first["data_wait_s"], first["ckpt_wait_s"]) == pytest.approx((0.3, 1.5))
    assert (second["data_wait_s"], second["ckpt_wait_s"]) == (0.0, 0.0)


@pytest.mark.parametrize("wait, step, shown", [
    (0.012, 0.1, "12%"), (0.005, 0.1, ""), (0.0051, 0.1, "5%"), (0.0, 0.1, ""),
    (0.3, 0.2, "100%"), (0.1, 0.0, "")])
def test_the_step_line_names_the_data_wait_above_a_few_percent(wait, step, shown):
    assert data_share(wait, step) == shown


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_bar_shows_the_data_wait_only_when_it_counts(tmp_path, monkeypatch):
    clock = iter([0.0, 1.0, 2.0])  # one second per step
    monkeypatch.setattr(sys, "stderr", Terminal())
    monkeypatch.setattr("ddpgpt.run.metrics.time.perf_counter", lambda: next(clock))
    metrics = Metrics(True, tmp_path / "metrics.jsonl", 0, 10, 1000, 6.0, peak=1e9,
                      world_size=1)
    metrics.waited(0.25, 0.0)
    metrics.log_step(1, 2.0, 3e-4, 1.0, 1.0)
    assert "data=25%" in str(metrics.bar)
    metrics.waited(0.01, 0.0)
    metrics.log_step(2, 2.0, 3e-4, 1.0, 2.0)
    assert "data=" not in str(metrics.bar)
    metrics.close()

"""metrics.jsonl's throughput figures: MFU can never read above 1."""

from __future__ import annotations

import io
import json
import sys
import time

from ddpgpt.run.metrics import Metrics


def test_mfu_cannot_exceed_one_when_the_measured_peak_reads_low(tmp_path, monkeypatch):
    """A startup peak measured on a busy machine can be lower than what the run then reaches
    (rows of 1.05 and 1.39 were seen). The peak is raised to any rate the run reaches, and stays
    raised, so each row's utilization is against the best rate known so far."""
    clock = iter([0.0, 1.0, 2.0, 3.0])  # one second per logged step
    monkeypatch.setattr("ddpgpt.run.metrics.time.perf_counter", lambda: next(clock))
    # 1,000 tokens per step, 6 FLOPs per token, 2 processes: 3,000 FLOP/s per process per
    # 1,000 tokens/s. The measured peak says 2,000 FLOP/s per device: too low.
    metrics = Metrics(True, tmp_path / "metrics.jsonl", 0, 3, 1000, 6.0, peak=2000.0,
                      world_size=2)
    rows = [metrics.log_step(s, 1.0, 1e-3, 1.0, float(s)) for s in (1, 2)]
    metrics.close()
    assert [r["mfu"] for r in rows] == [1.0, 1.0]  # not 1.5
    assert metrics.peak == 3000.0
    written = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert max(r["mfu"] for r in written) <= 1.0


def test_mfu_against_a_peak_the_run_does_not_reach(tmp_path, monkeypatch):
    clock = iter([0.0, 1.0])
    monkeypatch.setattr("ddpgpt.run.metrics.time.perf_counter", lambda: next(clock))
    metrics = Metrics(False, tmp_path / "metrics.jsonl", 0, 1, 1000, 6.0, peak=12000.0,
                      world_size=1)
    assert metrics.log_step(1, 1.0, 1e-3, 1.0, 1.0)["mfu"] == 0.5


class Tracker:
    def __init__(self):
        self.rows = []

    def log(self, step, row):
        self.rows.append((step, row))

    def close(self):
        pass


def test_eval_rows_and_line_hold_train_eval_loss_and_each_source(tmp_path, capsys):
    """What an evaluation of a mixture writes: every figure in metrics.jsonl and the tracker,
    and on the line the total as the weighted sum it is (the weights in force: it moves when
    they change), each source's val loss, and the train sample's loss."""
    tracker = Tracker()
    metrics = Metrics(True, tmp_path / "metrics.jsonl", 0, 10, 1000, 6.0, peak=1e9,
                      world_size=1, tracker=tracker)
    row = {"val_loss": 2.3, "val_bpb": None, "val_loss/a": 2.0, "train_eval_loss/a": 1.9,
           "val_loss/b": 3.0, "train_eval_loss/b": 2.9, "train_eval_loss": 2.2,
           "weight/a": 0.7, "weight/b": 0.3}
    metrics.log_eval(5, **row)
    metrics.close()
    written = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert written == {"step": 5, **{k: v for k, v in row.items() if v is not None}}
    assert tracker.rows == [(5, written)]
    assert ("step 5: val_loss 2.3000 = 0.7 × a 2.0000 + 0.3 × b 3.0000, train_eval_loss "
            "2.2000\n" in capsys.readouterr().out)


def test_step_rows_hold_the_realized_proportions_since_the_previous_row(tmp_path):
    metrics = Metrics(False, tmp_path / "metrics.jsonl", 0, 10, 1000, 6.0, peak=1e9,
                      world_size=1)
    metrics.taken_mark = {"a": 0, "b": 0}
    first = metrics.log_step(1, 1.0, 1e-3, 1.0, 1.0, {"a": 7, "b": 3})
    second = metrics.log_step(3, 1.0, 1e-3, 1.0, 1.0, {"a": 12, "b": 8})
    assert (first["mix/a"], first["mix/b"]) == (0.7, 0.3)
    assert (second["mix/a"], second["mix/b"]) == (0.5, 0.5)
    rewound = metrics.log_step(2, 1.0, 1e-3, 1.0, 1.0, {"a": 9, "b": 5})  # after a rollback
    assert "mix/a" not in rewound and metrics.taken_mark == {"a": 9, "b": 5}


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_bar_says_the_lr_and_leaves_paused_time_out(tmp_path, monkeypatch):
    """On a terminal: the step line holds the lr; the seconds inside paused() (an evaluation, a
    checkpoint, a sample) are in neither the bar's elapsed time nor its rate; finish_bar closes
    it before the final evaluation draws its own."""
    term = Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    metrics = Metrics(True, tmp_path / "metrics.jsonl", 0, 10, 1000, 6.0, peak=1e9,
                      world_size=1)
    metrics.log_step(1, 2.0, 3e-4, 1.0, 1.0)
    with metrics.paused():
        time.sleep(0.6)
    time.sleep(0.15)  # the step's own time
    metrics.log_step(2, 2.0, 2.5e-4, 1.0, 1.0)
    shown = metrics.bar.format_dict
    assert shown["elapsed"] < 0.45 and shown["rate"] > 3, shown  # 0.75 s and < 1.4 step/s
    assert "lr=0.00025" in str(metrics.bar)
    metrics.finish_bar()
    assert metrics.bar.disable and term.getvalue().endswith("\n")
    metrics.close()


def test_a_status_line_is_written_above_the_bar_not_over_it(tmp_path, monkeypatch):
    """errors.say, the one way a status line reaches stderr while a bar is drawn: the bar is
    taken away first (a carriage return), the line written whole, the bar drawn again."""
    from ddpgpt.errors import say, warn

    term = Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    metrics = Metrics(True, tmp_path / "metrics.jsonl", 0, 10, 1000, 6.0, peak=1e9,
                      world_size=1)
    metrics.log_step(1, 2.0, 3e-4, 1.0, 1.0)
    for line in ("ddpgpt: resuming with changed settings", "ddpgpt: warning: x"):
        say(line) if "warning" not in line else warn("x")
        before, after = term.getvalue().rsplit(line, 1)
        assert before.endswith("\r") and "train:" in before, repr(before[-200:])
        assert after.startswith("\n") and "train:" in after  # drawn again below
    metrics.close()

"""A two-dataset mixture trained through `-m ddpgpt train`: the same losses and per-source
evaluations at W=1 and W=2, a bitwise resume at the same W, and a resume at another W with the
weights changed, applied from the resume step and recorded.

The loader's rows themselves are held to a row-by-row oracle in tests/unit/test_mixture.py; here
the run around them: tolerances as tests/dist/test_equivalence.py's (only the order of float
sums differs between W)."""

import codecs
import json
import shutil
import this

import numpy as np
import pytest

from tests.helpers import read_metrics, tiny_train_args, write_dataset
from tests.processes import run_ranks

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]
STEPS, K, G = 6, 3, 8


@pytest.fixture(scope="module")
def prose(tmp_path_factory):
    """The Zen of Python's bytes, over and over, as a byte-level dataset."""
    text = np.frombuffer(codecs.decode(this.s, "rot13").encode(), dtype=np.uint8)
    return write_dataset(tmp_path_factory.mktemp("prose") / "zen", np.tile(text, 12),
                         text, 257, eot_id=256)


def mixture(tiny_data, prose, a=0.7, b=0.3) -> str:
    return f"{tiny_data}:{a},{prose}:{b}"


def train(tiny_data, prose, run_dir, W, **overrides):
    args = tiny_train_args(mixture(tiny_data, prose, **overrides.pop("weights", {})), run_dir,
                           STEPS, run__eval_every=K, **overrides)
    return run_ranks([args] * W, run_dir.parent / f"logs-{W}")


@pytest.fixture(scope="module")
def runs(tiny_data, prose, tmp_path_factory):
    out = {}
    for W in (1, 2):
        run_dir = tmp_path_factory.mktemp(f"mix{W}") / "run"
        train(tiny_data, prose, run_dir, W)
        out[W] = run_dir
    return out


def test_same_losses_and_per_source_evaluations_at_w1_and_w2(runs):
    (rows1, evals1), (rows2, evals2) = read_metrics(runs[1]), read_metrics(runs[2])
    np.testing.assert_allclose([r["loss"] for r in rows2], [r["loss"] for r in rows1], rtol=2e-5)
    assert [e["step"] for e in evals1] == [K, STEPS]
    keys = ["val_loss", "val_loss/tiny", "val_loss/zen", "train_eval_loss",
            "train_eval_loss/tiny", "train_eval_loss/zen"]
    for e1, e2 in zip(evals1, evals2):
        for key in keys:
            np.testing.assert_allclose(e2[key], e1[key], rtol=2e-5, err_msg=key)
        # the total is the weighted sum of the sources'
        assert e1["val_loss"] == pytest.approx(0.7 * e1["val_loss/tiny"] + 0.3 * e1["val_loss/zen"],
                                               rel=1e-12)
    # realized proportions: each step's rows, the same at both W (16 of 48 rows so far: 0.7·G
    # rounded by the schedule, never more than one row off)
    for r1, r2 in zip(rows1[1:], rows2[1:]):
        assert r1["mix/tiny"] == r2["mix/tiny"] and abs(r1["mix/tiny"] - 0.7) <= 1 / G
    total = sum(r["mix/tiny"] * G for r in rows1[1:])  # steps 2..6
    assert round(total) == int(0.7 * G * STEPS) - int(0.7 * G)
    sources = json.loads((runs[1] / "data_sources.json").read_text())
    assert [(s["name"], s["weight"]) for s in sources] == [("tiny", 0.7), ("zen", 0.3)]


def test_resume_at_the_same_world_size_is_bitwise(runs, tiny_data, prose, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(runs[2], run_dir)
    shutil.rmtree(run_dir / "checkpoints" / f"step_{STEPS:07d}")
    train(tiny_data, prose, run_dir, 2)
    rows, ref = read_metrics(run_dir)[0], read_metrics(runs[2])[0]
    assert [r["loss"] for r in rows] == [r["loss"] for r in ref]
    assert [r["mix/zen"] for r in rows[1:]] == [r["mix/zen"] for r in ref[1:]]


@pytest.fixture(scope="module")
def changed(runs, tiny_data, prose, tmp_path_factory):
    """The W=1 run resumed from step K at W=2 with the weights changed to 0.5/0.5: (its run
    dir, its ranks' results). Checked and drawn by the two tests below."""
    run_dir = tmp_path_factory.mktemp("changed") / "run"
    shutil.copytree(runs[1], run_dir)
    shutil.rmtree(run_dir / "checkpoints" / f"step_{STEPS:07d}")
    return run_dir, train(tiny_data, prose, run_dir, 2, weights={"a": 0.5, "b": 0.5})


def test_changed_weights_on_resume_at_another_w_are_applied_and_recorded(runs, changed, tiny_data,
                                                                          prose):
    run_dir, results = changed
    assert ("ddpgpt: the mixture changed on resume (applied from step 3): tiny 0.7 -> 0.5, "
            "zen 0.3 -> 0.5") in results[0].stderr
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    events = [r for r in rows if r.get("event") == "mixture_change"]
    assert events == [{"step": K, "event": "mixture_change",
                       "checkpoint": str(run_dir / "checkpoints" / f"step_{K:07d}"),
                       "old": {"tiny": 0.7, "zen": 0.3}, "new": {"tiny": 0.5, "zen": 0.5}}]
    train_rows = [r for r in rows if "loss" in r]
    ref = read_metrics(runs[1])[0]
    assert [r["loss"] for r in train_rows[:K]] == [r["loss"] for r in ref[:K]]
    assert [r["mix/tiny"] for r in train_rows[K:]] == [0.5] * (STEPS - K)
    config = json.loads((run_dir / "config.json").read_text())
    assert config["data"]["dir"] == mixture(tiny_data, prose, 0.5, 0.5)


def test_a_mixture_runs_plot_shows_its_sources_and_the_change(changed, tmp_path, monkeypatch):
    """The run of weights changed on resume (`changed`), drawn: each source's val and
    train-sample loss as metrics.jsonl holds them, the shares, the change marked at its step; its
    eval lines say the headline is the weighted sum, with the weights in force."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from ddpgpt.cli import main

    run_dir, results = changed
    rows, evals = read_metrics(run_dir)
    last = evals[-1]
    assert (f"step {STEPS}: val_loss {last['val_loss']:.4f} = 0.5 × tiny "
            f"{last['val_loss/tiny']:.4f} + 0.5 × zen {last['val_loss/zen']:.4f}, ") \
        in results[0].stdout, results[0].stdout
    assert [(e["weight/tiny"], e["weight/zen"]) for e in evals] == [(0.7, 0.3), (0.5, 0.5)]
    figures, close = [], plt.close
    monkeypatch.setattr(plt, "close", lambda fig=None: (figures.append(fig), close(fig)))
    main(["plot", str(run_dir), "--out", str(tmp_path / "mix.png")])
    fig = figures[0]
    lines = {line.get_gid(): line for axis in fig.axes for line in axis.lines if line.get_gid()}
    for name in ("tiny", "zen"):
        np.testing.assert_array_equal(lines[f"val {name}"].get_xdata(), [K, STEPS])
        np.testing.assert_array_equal(lines[f"val {name}"].get_ydata(),
                                      [e[f"val_loss/{name}"] for e in evals])
        np.testing.assert_array_equal(lines[f"train sample {name}"].get_ydata(),
                                      [e[f"train_eval_loss/{name}"] for e in evals])
        shares = [(r["step"], r[f"mix/{name}"]) for r in rows if f"mix/{name}" in r]
        np.testing.assert_array_equal(lines[f"share {name}"].get_xdata(), [s for s, _ in shares])
        assert len(shares) >= STEPS - 1
    (mark,) = fig.axes[0].texts  # (the copied run's run.dir changed too)
    assert mark.get_text().startswith(" tiny 0.7→0.5, zen 0.3→0.5")

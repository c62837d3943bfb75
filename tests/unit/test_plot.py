"""`ddpgpt plot`: a PNG of any set of runs, one line for what it cannot draw."""

import json
import math
import sys

import numpy as np
import pytest

from ddpgpt.cli import main
from ddpgpt.commands.plot import auto_beta, smoothed


def fake_run(path, optimizer: str, steps: int = 20, eval_every: int = 5):
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"optim": {"name": optimizer},
                                                  "run": {"sync": "ddp"}}))
    rows = [{"step": s, "loss": 8 - s / 10, "lr": 1e-3, "grad_norm": 1.0, "tokens": 4096 * s,
             "tokens_per_s": 2000.0 + s, "mfu": 0.5, "elapsed_s": s} for s in range(1, steps + 1)]
    rows += [{"step": s, "val_loss": 8 - s / 9} for s in range(eval_every, steps + 1, eval_every)]
    lines = [json.dumps(r) for r in sorted(rows, key=lambda r: r["step"])]
    (path / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": 21, "lo')  # torn last line
    return path


def test_plot_draws_runs_next_to_the_first(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    a, b = fake_run(tmp_path / "adamw", "adamw"), fake_run(tmp_path / "muon", "muon", steps=30)
    main(["plot", str(a), str(b)])
    png = tmp_path / "adamw.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert capsys.readouterr().err.strip() == f"wrote {png}"
    main(["plot", str(b), "--out", str(tmp_path / "one.png")])
    assert (tmp_path / "one.png").stat().st_size > 1000


@pytest.mark.parametrize("case, message", [
    ("missing", "{p}: no such run dir; give run dirs that `ddpgpt train` wrote"),
    ("empty", "{p}: no metrics.jsonl; give run dirs that `ddpgpt train` wrote"),
    ("damaged", "{p}/metrics.jsonl: line 1 is not JSON; the file is damaged (restore it, or "
                "plot other runs)"),
])
def test_what_cannot_be_drawn_is_one_line(case, message, tmp_path, capsys):
    path = tmp_path / "run"
    if case == "empty":
        path.mkdir()
    if case == "damaged":
        fake_run(path, "adamw")
        text = (path / "metrics.jsonl").read_text()
        (path / "metrics.jsonl").write_text("not json\n" + text)
    with pytest.raises(SystemExit) as e:
        main(["plot", str(path)])
    assert e.value.code == 2
    assert capsys.readouterr().err == f"ddpgpt: error: {message.format(p=path)}\n"
    assert not (tmp_path / "run.png").exists()


def test_a_mistyped_run_names_the_run_meant(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    fake_run(tmp_path / "runs" / "mix", "adamw")
    with pytest.raises(SystemExit):
        main(["plot", "runs/mxi"])
    assert capsys.readouterr().err == ("ddpgpt: error: runs/mxi: no such run dir (did you mean "
                                       "runs/mix?); give run dirs that `ddpgpt train` wrote\n")


def test_without_matplotlib_it_says_how_to_install(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails as if not installed
    with pytest.raises(SystemExit):
        main(["plot", str(fake_run(tmp_path / "run", "adamw"))])
    assert capsys.readouterr().err == ("ddpgpt: error: plot needs matplotlib: "
                                       "pip install 'ddpgpt[plot]'\n")


def rewrite_rows(path, edit):
    """The run's rows (torn last line dropped) through `edit`, written back one per line."""
    rows = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()[:-1]]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in edit(rows)))


@pytest.mark.parametrize("smooth", ["-1", "0", "0.9"])
def test_skipped_steps_and_rows_without_tokens_are_drawn(tmp_path, capsys, smooth):
    """`"loss": null` is what the trainer writes for a step skipped as non-finite; rows of older
    or hand-made files may lack `tokens` (the token panel is then left empty)."""
    pytest.importorskip("matplotlib")
    a, b = fake_run(tmp_path / "a", "adamw"), fake_run(tmp_path / "b", "muon")
    rewrite_rows(a, lambda rows: [{**r, "loss": None, "grad_norm": None}
                                  if r["step"] in (1, 7) and "loss" in r else r for r in rows])
    rewrite_rows(b, lambda rows: [{k: v for k, v in r.items() if k != "tokens"} for r in rows])
    main(["plot", str(a), str(b), "--smooth", smooth])
    assert (tmp_path / "a.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_auto_smoothing_follows_the_run_length():
    """A 20-row run is drawn as logged; a fixed 0.9 would lag its falling loss by ~10 rows."""
    falling = [8 - s / 4 for s in range(20)]
    assert smoothed(falling, auto_beta(20)) == falling
    lag = smoothed(falling, 0.9)[-1] - falling[-1]
    assert lag > 1.0  # what the old default drew: ~1 nat above the last row here
    assert auto_beta(2000) == pytest.approx(0.99)
    assert smoothed([1.0, None, 3.0], 0.5) == [1.0, None, pytest.approx(1 / 3 + 2)]


@pytest.mark.parametrize("out, written", [
    ("noext", "noext.png"),  # matplotlib would append .png while we printed "noext"
    ("pic.svg", "pic.svg"),
    ("folder", "folder/run.png"),  # an existing directory: the run's name inside it
])
def test_the_printed_path_is_the_file_written(tmp_path, capsys, monkeypatch, out, written):
    pytest.importorskip("matplotlib")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "folder").mkdir()
    fake_run(tmp_path / "run", "adamw")
    main(["plot", "run", "--out", out])
    assert capsys.readouterr().err == f"wrote {written}\n"
    assert (tmp_path / written).stat().st_size > 1000


def test_plot_dot_inside_a_run_dir(tmp_path, capsys, monkeypatch):
    pytest.importorskip("matplotlib")
    monkeypatch.chdir(fake_run(tmp_path / "run", "adamw"))
    main(["plot", "."])
    assert capsys.readouterr().err == f"wrote {tmp_path / 'run.png'}\n"
    assert (tmp_path / "run.png").is_file()


@pytest.mark.parametrize("case, message", [
    ("not utf-8", "{m}: not UTF-8 text (byte 1); the file is damaged (restore it, or plot other "
                  "runs)"),
    ("bare value", "{m}: line 2 is not a metrics row (a JSON object with an integer \"step\"); "
                   "the file is damaged (restore it, or plot other runs)"),
    ("bad format", "--out {p}.xyz: cannot draw a .xyz file; give a name ending in .png, .pdf, "
                   ".svg (or a directory)"),
    ("full disk", "cannot write /dev/full: No space left on device (ENOSPC); choose another "
                  "--out"),
])
def test_odd_files_and_outputs_are_one_line(case, message, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = fake_run(tmp_path / "run", "adamw")
    metrics, args = path / "metrics.jsonl", ["plot", str(path)]
    if case == "not utf-8":
        metrics.write_bytes(b"{\xff\xfe}\n" + metrics.read_bytes())
    elif case == "bare value":
        metrics.write_text(metrics.read_text().replace("\n", "\n42\n", 1))
    elif case == "bad format":
        args += ["--out", f"{path}.xyz"]
    else:
        args += ["--out", "/dev/full"]
    with pytest.raises(SystemExit) as e:
        main(args)
    assert e.value.code == 2
    assert capsys.readouterr().err == f"ddpgpt: error: {message.format(p=path, m=metrics)}\n"
    assert not (tmp_path / "run.png").exists()


def test_the_picture_holds_the_runs_numbers(tmp_path, monkeypatch):
    """What is drawn, not only that a PNG came out: each panel's lines carry the rows' values (a
    skipped step a gap), the val points the eval rows, the token axis steps × tokens per step."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    figures, close = [], plt.close
    monkeypatch.setattr(plt, "close", lambda fig=None: (figures.append(fig), close(fig)))
    a = fake_run(tmp_path / "a", "adamw", steps=12, eval_every=4)
    rewrite_rows(a, lambda rows: [{**r, "loss": None} if r["step"] == 7 and "loss" in r else r
                                  for r in rows])
    main(["plot", str(a), "--smooth", "0"])
    by_step, by_tokens, speed = figures[0].axes
    raw, smooth, val = by_step.lines[:3]
    steps = list(range(1, 13))
    expected = [math.nan if s == 7 else 8 - s / 10 for s in steps]
    np.testing.assert_array_equal(raw.get_xdata(), steps)
    np.testing.assert_allclose(raw.get_ydata(), expected)
    np.testing.assert_allclose(smooth.get_ydata(), expected)  # --smooth 0: the raw line
    np.testing.assert_array_equal(val.get_xdata(), [4, 8, 12])
    np.testing.assert_allclose(val.get_ydata(), [8 - s / 9 for s in (4, 8, 12)])
    np.testing.assert_array_equal(by_tokens.lines[0].get_xdata(), [4096 * s for s in steps])
    np.testing.assert_allclose(speed.lines[0].get_ydata(), [2000.0 + s for s in steps])


def test_stops_restarts_and_rollbacks_are_marked(tmp_path, monkeypatch):
    """Vertical lines on the steps panel where the run stopped (a stop row), started again with
    other settings (configs.jsonl) and rolled back (at the spike), one legend entry each."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    figures, close = [], plt.close
    monkeypatch.setattr(plt, "close", lambda fig=None: (figures.append(fig), close(fig)))
    a = fake_run(tmp_path / "a", "adamw")
    rewrite_rows(a, lambda rows: rows + [
        {"step": 8, "event": "stop", "message": "stopped", "exit_code": 75},
        {"step": 10, "event": "rollback", "spike_step": 15, "checkpoint_step": 10}])
    (a / "configs.jsonl").write_text('{"step": 0, "config": {}}\n{"step": 12, "config": {}}\n')
    main(["plot", str(a)])
    by_step = figures[0].axes[0]
    vertical = {(line.get_xdata()[0], str(line.get_linestyle())) for line in by_step.lines
                if len(set(line.get_xdata())) == 1 and len(line.get_xdata()) == 2}
    assert vertical == {(8, "--"), (12, "-."), (15, ":")}
    labels = [t.get_text() for t in figures[0].legends[0].get_texts()]
    assert {"stopped", "restarted", "rolled back"} <= set(labels)


def test_a_run_is_labelled_by_the_world_size_it_trained_most_steps_at(tmp_path):
    """180 steps at W=2, then 20 at W=1 after a resume (its checkpoint saved at W=1): W=2, and
    the stretch at W=1 said; a start from an older checkpoint replaces the steps after it."""
    from ddpgpt.commands.plot import load_run

    a = fake_run(tmp_path / "a", "adamw", steps=200)
    (a / "checkpoints" / "step_0000200").mkdir(parents=True)
    (a / "checkpoints" / "step_0000200" / "meta.json").write_text('{"world_size": 1}')
    starts = [(0, 2), (180, 1)]
    (a / "configs.jsonl").write_text("".join(
        json.dumps({"step": s, "world_size": w, "config": {}}) + "\n" for s, w in starts))
    assert load_run(str(a))["label"] == "a (adamw, ddp, W=2; W=1 for 20 of 200 steps)"
    # W=1 from step 50 (back from a crash at 180 to the checkpoint of step 50): 150 steps at 1
    with open(a / "configs.jsonl", "a") as f:
        f.write(json.dumps({"step": 50, "world_size": 1, "config": {}}) + "\n")
    assert load_run(str(a))["label"] == "a (adamw, ddp, W=1; W=2 for 50 of 200 steps)"
    # one world size throughout; a run from before configs.jsonl held it: its checkpoint's
    (a / "configs.jsonl").write_text('{"step": 0, "world_size": 4, "config": {}}\n')
    assert load_run(str(a))["label"] == "a (adamw, ddp, W=4)"
    (a / "configs.jsonl").write_text('{"step": 0, "config": {}}\n')
    assert load_run(str(a))["label"] == "a (adamw, ddp, W=1)"


def test_a_mixture_is_drawn_source_by_source_with_its_shares_and_changes(tmp_path, monkeypatch):
    """A mixture's run, its weights changed on resume at step 10: each source's val and
    train-sample loss as written, the realized shares and the weights, and a mark at 10 that
    says what changed (the weights, and the lr) beside the unchanged mark of a stop."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    figures, close = [], plt.close
    monkeypatch.setattr(plt, "close", lambda fig=None: (figures.append(fig), close(fig)))
    a = fake_run(tmp_path / "a", "adamw")
    weight = {s: (0.7, 0.3) if s <= 10 else (0.5, 0.5) for s in range(21)}
    rewrite_rows(a, lambda rows: [
        {**r, "mix/web": weight[r["step"]][0], "mix/code": weight[r["step"]][1]}
        if "loss" in r else
        {**r, "val_loss/web": r["val_loss"] - 1, "val_loss/code": r["val_loss"] + 1,
         "train_eval_loss/web": r["val_loss"] - 2, "train_eval_loss/code": r["val_loss"],
         "weight/web": weight[r["step"]][0], "weight/code": weight[r["step"]][1]}
        for r in rows] + [
        {"step": 10, "event": "mixture_change", "checkpoint": "c",
         "old": {"web": 0.7, "code": 0.3}, "new": {"web": 0.5, "code": 0.5}},
        {"step": 10, "event": "config_change", "checkpoint": "c",
         "changes": {"data.dir": ["w:0.7,c:0.3", "w:0.5,c:0.5"], "optim.lr": [0.3, 30.0]}},
        {"step": 4, "event": "stop", "message": "stopped", "exit_code": 75}])
    (a / "configs.jsonl").write_text('{"step": 0, "config": {}}\n{"step": 10, "config": {}}\n')
    main(["plot", str(a), "--smooth", "0"])
    fig = figures[0]
    by_step, per_source, shares = fig.axes[0], fig.axes[-2], fig.axes[-1]
    lines = {line.get_gid(): line for line in per_source.lines + shares.lines}
    evals = [5, 10, 15, 20]
    for name, offset in (("web", -1), ("code", 1)):
        np.testing.assert_array_equal(lines[f"val {name}"].get_xdata(), evals)
        np.testing.assert_allclose(lines[f"val {name}"].get_ydata(),
                                   [8 - s / 9 + offset for s in evals])
        np.testing.assert_allclose(lines[f"train sample {name}"].get_ydata(),
                                   [8 - s / 9 + offset - 1 for s in evals])
    np.testing.assert_allclose(lines["share web"].get_ydata(),
                               [0.7] * 10 + [0.5] * 10)  # --smooth 0: as logged
    np.testing.assert_allclose(lines["weight code"].get_ydata(), [0.3, 0.3, 0.5, 0.5])
    vertical = {(line.get_xdata()[0], str(line.get_linestyle())) for line in by_step.lines
                if len(set(line.get_xdata())) == 1 and len(line.get_xdata()) == 2}
    assert vertical == {(4, "--"), (10, "-")}  # the resume at 10 is a change, not a restart
    assert [t.get_text() for t in by_step.texts] == [
        " web 0.7→0.5, code 0.3→0.5; optim.lr 0.3→30"]
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert "settings changed" in labels and "restarted" not in labels
    assert "val loss (a mixture's: weighted by its weights then)" in labels


@pytest.mark.parametrize("waits", [True, False])
def test_the_waits_are_drawn_when_a_run_logged_them(tmp_path, monkeypatch, waits):
    """data_wait_s and ckpt_wait_s on the tokens/s panel's right axis, one line each per run,
    with the rows' values; a metrics.jsonl from before they were logged draws as it did."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    figures, close = [], plt.close
    monkeypatch.setattr(plt, "close", lambda fig=None: (figures.append(fig), close(fig)))
    a = fake_run(tmp_path / "a", "adamw", steps=6)
    if waits:
        rewrite_rows(a, lambda rows: [{**r, "data_wait_s": r["step"] / 100, "ckpt_wait_s": 0.0}
                                      if "loss" in r else r for r in rows])
    main(["plot", str(a)])
    axes = figures[0].axes
    labels = [t.get_text() for t in figures[0].legends[0].get_texts()]
    if not waits:
        assert len(axes) == 3 and not any("waited" in label for label in labels)
        return
    right = axes[3]
    assert right.bbox.bounds == axes[2].bbox.bounds  # the tokens/s panel's twin
    data, ckpt = right.lines
    np.testing.assert_array_equal(data.get_xdata(), range(1, 7))
    np.testing.assert_allclose(data.get_ydata(), [s / 100 for s in range(1, 7)])
    np.testing.assert_allclose(ckpt.get_ydata(), [0.0] * 6)
    assert {"waited for data (s per step, right axis)",
            "waited for checkpoints (s per step, right axis)"} <= set(labels)

"""`ddpgpt plot`: a PNG of any set of runs, one line for what it cannot draw."""

import json
import sys

import pytest

from ddpgpt.cli import main


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
    ("missing", "{p}: no metrics.jsonl; give run dirs that `ddpgpt train` wrote"),
    ("damaged", "{p}/metrics.jsonl: line 1 is not JSON; the file is damaged (restore it, or "
                "plot other runs)"),
])
def test_what_cannot_be_drawn_is_one_line(case, message, tmp_path, capsys):
    path = tmp_path / "run"
    if case == "damaged":
        fake_run(path, "adamw")
        text = (path / "metrics.jsonl").read_text()
        (path / "metrics.jsonl").write_text("not json\n" + text)
    with pytest.raises(SystemExit) as e:
        main(["plot", str(path)])
    assert e.value.code == 2
    assert capsys.readouterr().err == f"ddpgpt: error: {message.format(p=path)}\n"
    assert not (tmp_path / "run.png").exists()


def test_without_matplotlib_it_says_how_to_install(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails as if not installed
    with pytest.raises(SystemExit):
        main(["plot", str(fake_run(tmp_path / "run", "adamw"))])
    assert capsys.readouterr().err == ("ddpgpt: error: plot needs matplotlib: "
                                       "pip install 'ddpgpt[plot]'\n")

"""A run whose checkpoints are at a URL (run.checkpoint_url) is read from that URL alone by every
command that takes a run dir: eval, sample, export, plot and prepare --tokenizer-from give what
they give for its local run dir, which keeps the same files. One bpe run in S3 serves them all
(the `bpe_at_url` fixture); each command runs in this process. A training's own run dir stays
local: a URL there is one line."""

from __future__ import annotations

import json

import pytest

from ddpgpt import cli
from ddpgpt.commands import eval as eval_command
from ddpgpt.commands import export, plot, sample
from ddpgpt.config.commands import (
    EvalConfig,
    ExportConfig,
    PlotConfig,
    PrepareConfig,
    SampleConfig,
)
from ddpgpt.data.prepare import main as prepare
from ddpgpt.errors import UserError
from tests.conftest import STDLIB

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def both(run, capsys, **settings) -> tuple[str, str]:
    """What `run(cfg)` prints for the run at its URL, then for its local run dir."""
    out = []
    for where in (run.url, str(run.run)):
        capsys.readouterr()
        settings["command"](settings["config"](run_dir=where, **settings["flags"]))
        out.append(capsys.readouterr().out)
    return out[0], out[1]


def test_eval_and_sample_read_the_url_alone(s3, bpe_at_url, capsys):
    url, local = both(bpe_at_url, capsys, command=eval_command.run, config=EvalConfig,
                      flags={"device": "cpu", "json": True})
    assert url == local and json.loads(url)["step"] == 2, url
    url, local = both(bpe_at_url, capsys, command=sample.run, config=SampleConfig,
                      flags={"device": "cpu", "temperature": 0, "max_new_tokens": 8,
                             "prompt": "def "})
    assert url == local and url.startswith("def "), url


def test_export_reads_the_url_alone(s3, bpe_at_url, tmp_path, capsys):
    """The bpe tokenizer too: it was read from a local path named by the URL (a traceback)."""
    run = bpe_at_url
    for name, where in (("url", run.url), ("local", str(run.run))):
        export.run(ExportConfig(run_dir=where, out=str(tmp_path / name)))
        assert capsys.readouterr().out.startswith(f"exported {run.url}/step_0000002 (step 2) to "
                                                  f"{tmp_path / name}: ")
    url, local = tmp_path / "url", tmp_path / "local"
    files = sorted(p.name for p in local.iterdir())
    assert "tokenizer.json" in files and sorted(p.name for p in url.iterdir()) == files
    for name in files:
        assert (url / name).read_bytes() == (local / name).read_bytes(), name


def test_plot_reads_the_url_alone(s3, bpe_at_url, tmp_path, monkeypatch):
    """The run puts its config.json, configs.jsonl and metrics.jsonl beside its checkpoints;
    plot URL draws what plot RUN_DIR draws, into NAME.png here."""
    run = bpe_at_url
    for name in ("config.json", "configs.jsonl", "metrics.jsonl"):
        assert s3.fs().cat_file(f"{run.url[5:]}/{name}") == (run.run / name).read_bytes(), name
    assert plot.load_run(run.url) == plot.load_run(str(run.run))
    monkeypatch.chdir(tmp_path)
    plot.run(PlotConfig(runs=[run.url]))
    assert (tmp_path / "bpe.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_prepare_takes_the_tokenizer_of_a_run_at_a_url(s3, bpe_at_url, tmp_path):
    """What eval's refusal of another tokenizer tells to run: prepare --tokenizer-from RUN."""
    prepare.run(PrepareConfig(sources=[str(STDLIB / "colorsys.py")], out=str(tmp_path / "data"),
                              tokenizer_from=bpe_at_url.url, workers=1))
    assert json.loads((tmp_path / "data" / "meta.json").read_text())["tokenizer"] == "bpe"
    assert (tmp_path / "data" / "tokenizer.json").read_bytes() == \
        (bpe_at_url.run / "tokenizer.json").read_bytes()


@pytest.mark.parametrize("data", [False, True])
def test_a_training_refuses_a_url_for_its_run_dir(tiny_data, tmp_path, data):
    """Its run dir holds its lock, config and metrics: a URL there is one line naming the flag
    that puts the checkpoints at a URL, also to continue a run (no --data); nothing is read."""
    url = "s3://bucket/runs/a"
    with pytest.raises(UserError) as e:
        cli.dispatch(["train", "--run-dir", url, *(["--data", str(tiny_data)] if data else []),
                      "--device", "cpu"])
    assert str(e.value) == (f"--run-dir {url}: a training's run dir is a local directory (its "
                            "lock, config and metrics); to keep its checkpoints at that URL, give "
                            f"--run-dir DIR --run.checkpoint-url {url}")

"""Fine-tuning from a run's export, as a user does it: the data prepared with the tokenizer the
export holds (`prepare --tokenizer-from` the transformers directory, the way the refusal of
other data says), then `train --init-from` the directory, which says what it read, what the
weights changed of the preset (the context, the tokens per step), and evaluates before the first
step (step 0: the weights' loss on the new data).

One module-scoped story: a bpe run of 2 steps and its export, a second corpus prepared three
ways (its own bpe, the run's tokenizer, the export's), and the fine-tuning run."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from ddpgpt.checkpoint.read import load_model
from ddpgpt.config.commands import PrepareConfig
from ddpgpt.config.io import from_dict
from ddpgpt.data.prepare import main as prepare
from ddpgpt.data.shards import TokenDataset
from ddpgpt.distributed.group import DistEnv
from ddpgpt.evals.loss import eval_sets, evaluate_sets
from ddpgpt.run.run_dir import RunDir
from tests.helpers import read_metrics
from tests.in_process import run_in_process

pytest.importorskip("transformers")
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]
STDLIB = Path(sysconfig.get_paths()["stdlib"])
FIRST = ["textwrap.py", "shlex.py", "bisect.py", "heapq.py"]
SECOND = ["fnmatch.py", "glob.py", "colorsys.py", "keyword.py", "string.py"]
SMALL = ["--data.micro-batch", "2", "--data.global-batch", "8", "--data.eval-windows", "8",
         "--optim.warmup-steps", "2", "--optim.lr", "1e-2", "--device", "cpu",
         "--run.threads", "1", "--run.eval-every", "0"]


def _ok(r):
    assert r.returncode == 0, r.stderr
    return r


def _prepare(out: Path, files: list[str], **settings) -> Path:
    settings = settings or {"vocab_size": 300}
    prepare.run(PrepareConfig(sources=[str(STDLIB / f) for f in files], out=str(out),
                              val_fraction=0.4, **settings))
    return out


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    root = tmp_path_factory.mktemp("finetune")
    data, run, out = _prepare(root / "first", FIRST), root / "run", root / "exported"
    _ok(run_in_process("train", "--data", data, "--run-dir", run, "--model.n-layer", "1",
                       "--model.n-head", "2", "--model.n-embd", "32", "--model.block-size", "32",
                       "--run.steps", "2", *SMALL))
    _ok(run_in_process("export", "--run-dir", run, "--out", out))
    own = _prepare(root / "own", SECOND)  # a bpe of its own: not the weights' ids
    refused = run_in_process("train", "--data", own, "--run-dir", root / "refused", "--init-from",
                             out, *SMALL)
    # what the refusal says to run, as it says it
    second = root / "second"
    _ok(run_in_process("prepare", *(STDLIB / f for f in SECOND), "--tokenizer-from", out, "--out",
                       second, "--val-fraction", "0.4"))
    by_run = _prepare(root / "by-run", SECOND, tokenizer_from=str(run))
    tuned = root / "tuned"
    trained = _ok(run_in_process("train", "--data", second, "--run-dir", tuned, "--init-from", out,
                                 "--preset", "tiny", "--run.steps", "1", *SMALL))
    return SimpleNamespace(run=run, out=out, own=own, refused=refused, second=second,
                           by_run=by_run, tuned=tuned, trained=trained)


def test_data_for_an_export_is_prepared_with_the_tokenizer_it_holds(tuned):
    """`prepare --tokenizer-from` the export: the same ids as with the run's own tokenizer."""
    a, b = TokenDataset(tuned.second), TokenDataset(tuned.by_run)
    for split in ("train", "val"):
        np.testing.assert_array_equal(np.concatenate(a.tokens(split)),
                                      np.concatenate(b.tokens(split)))
    assert a.tokenizer == "bpe" and len(a.tokens("train")[0]) > 1000


def test_the_refusal_of_other_data_says_a_command_that_works(tuned):
    """Data of another bpe is refused, and the line's command is the one the story then runs
    (the fixture's second dataset is made by it, and trained on below)."""
    assert tuned.refused.returncode == 2
    assert tuned.refused.stderr.endswith(
        f"its ids would mean other text; prepare the data with theirs: ddpgpt prepare SOURCES "
        f"--tokenizer-from {tuned.out} --out DIR\n"), tuned.refused.stderr


def test_init_from_says_what_it_read_and_what_it_changed(tuned):
    """The tiny preset's 4 layers of 256 with T=256 became the weights' 1 layer of 32 with
    T=32: said once, with the tokens per step; then what was read."""
    err = tuned.trained.stderr
    assert (f"ddpgpt: --init-from {tuned.out}: the model's shape from its weights: n_layer 4 -> "
            "1, n_head 4 -> 2, n_embd 256 -> 32, block_size 256 -> 32") in err, err
    assert "; T 256 -> 32: G=8 × T=32 = 256 tokens per step (was 2,048)\n" in err
    assert err.count(f"ddpgpt: started from the weights of {tuned.out}: 0.0") == 1
    assert "G=8 sequences × T=32 = 256 tokens per step" in err


def test_init_from_evaluates_before_the_first_step(tuned):
    """Step 0's val loss is the exported weights' on the new data: the original run's
    checkpoint evaluated on the same windows, in this process."""
    _, evals = read_metrics(tuned.tuned)
    assert [r["step"] for r in evals] == [0, 1]
    assert f"step 0: val_loss {evals[0]['val_loss']:.4f}" in tuned.trained.stdout
    cfg = from_dict(json.loads((tuned.tuned / "config.json").read_text()))
    assert cfg.run.eval_at_start is True
    model, _ = load_model(RunDir(tuned.run), "cpu")
    sets = eval_sets(TokenDataset(tuned.second), seq_len=cfg.seq_len,
                     micro_batch=cfg.data.micro_batch, world_size=1, rank=0,
                     eval_windows=cfg.data.eval_windows, train_windows=0, seed=cfg.data.seed,
                     device="cpu", align=cfg.data.align)
    want = evaluate_sets(model, sets, DistEnv())["val_loss"]
    assert evals[0]["val_loss"] == pytest.approx(want, rel=1e-5)


def test_evaluating_before_the_first_step_is_on_for_init_from_and_a_flag_otherwise(tuned):
    """Unset, run.eval_at_start follows --init-from; either way a flag decides."""
    from ddpgpt import cli
    from ddpgpt.run.preflight import preflight

    def first(*argv: str) -> bool:
        ns = cli._build_parser().parse_args(["train", "--data", str(tuned.second), *argv])
        cfg = cli.train_config({k: v for k, v in vars(ns).items()
                                if k not in ("command", "debug")})[0]
        return preflight(cfg, 1, 1)[0].run.eval_at_start

    assert [first(), first("--run.eval-at-start"), first("--init-from", str(tuned.out)),
            first("--init-from", str(tuned.out), "--no-run.eval-at-start")] == [
        False, True, True, False]

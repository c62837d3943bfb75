"""Multiple-choice tasks, time to target and wsd through the real command line: the same task
scores during training at W=1 and W=2 and from `ddpgpt eval` at W=1 and W=2, equal to an
independent implementation of llm.c's definition; a run stopped at its target val loss and
resumed with more steps on a flat wsd schedule; an export scored by transformers and by
lm-evaluation-harness as ddpgpt scores it.

One set of runs is shared by the module's tests: W=1 and W=2 runs of 8 steps evaluating two
tasks every 2 steps, and a W=1 run with a target val loss, later resumed."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from ddpgpt.checkpoint import read
from ddpgpt.config.io import from_dict
from ddpgpt.data.tokenizer import ByteTokenizer
from ddpgpt.evals import tasks
from ddpgpt.evals.multiple_choice import Example, ending_losses, render
from ddpgpt.model.gpt import GPT
from ddpgpt.optim.schedule import lr_at
from tests import hellaswag_oracle as oracle
from tests.helpers import read_metrics, tiny_train_args, write_dataset
from tests.in_process import run_in_process
from tests.processes import run_ranks

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]
SCORES = ("acc_norm", "acc", "acc_char", "n")


def _ok(r):
    assert r.returncode == 0, r.stderr
    return r


def _train(data: Path, run: Path, *extra: str, **flags):
    common = dict(steps=8, run__eval_every=2, optim__schedule="wsd", optim__decay_fraction=0.25,
                  model__vocab_size=257)  # no padding rows: the export is the same model
    return _ok(run_in_process(*tiny_train_args(data, run, **{**common, **flags})[2:], *extra))


def _task_scores(row: dict) -> dict:
    return {k: v for k, v in row.items() if k.split("_")[0] in ("mine", "hellaswag")
            and not k.endswith("_s")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tasks")
    rng = np.random.default_rng(0)
    text = np.frombuffer(" ".join(oracle.write_examples.__doc__.split()).encode() * 200,
                         dtype=np.uint8)
    data = write_dataset(root / "data", text[:20000], text[20000:26000], vocab_size=257,
                         eot_id=256, kind="byte")
    mine, hs = root / "mine.jsonl", root / "hs.jsonl"
    rows = {"mine": oracle.write_examples(mine, 13, seed=5),  # 7 and 6 per rank at W=2
            "hellaswag": oracle.write_examples(hs, 9, seed=int(rng.integers(100)))}
    task_flags = dict(run__eval_tasks="mine,hellaswag", run__eval_task_data=f"{mine},{hs}")
    w1, w2, target = root / "w1", root / "w2", root / "target"
    _train(data, w1, run__tracker="tensorboard", **task_flags)
    _train(data, w2, "--nproc", "2", **task_flags)
    val4 = next(r["val_loss"] for r in read_metrics(w1)[1] if r["step"] == 4)
    stopped = _train(data, target, run__target_val_loss=val4)
    stopped_rows = [json.loads(line)
                    for line in (target / "metrics.jsonl").read_text().splitlines()]
    resumed = _train(data, target, steps=12, run__target_val_loss=0)
    return SimpleNamespace(root=root, data=data, w1=w1, w2=w2, target=target, val4=val4,
                           stopped=stopped, stopped_rows=stopped_rows, resumed=resumed,
                           rows=rows, files={"mine": mine, "hellaswag": hs})


def _model(run: Path) -> GPT:
    _, meta, state = read.load_latest(run / "checkpoints")
    model = GPT(from_dict(meta["config"]).model).eval()
    model.load_state_dict(state["model"])
    return model


def test_task_scores_during_training_are_the_same_at_w1_and_w2(runs):
    one, two = read_metrics(runs.w1)[1], read_metrics(runs.w2)[1]
    assert [r["step"] for r in one] == [r["step"] for r in two] == [2, 4, 6, 8]
    for a, b in zip(one, two):
        assert _task_scores(a) == _task_scores(b) and a["val_loss"] == pytest.approx(
            b["val_loss"], abs=1e-5)
        assert {f"{t}_{s}" for t in ("mine", "hellaswag") for s in SCORES} <= a.keys()
        assert (a["mine_n"], a["hellaswag_n"]) == (13, 9)
        assert a["mine_s"] > 0 and a["train_s"] + a["eval_s"] + a["checkpoint_s"] == \
            pytest.approx(a["elapsed_s"], abs=1e-9)


def test_task_scores_reach_the_tracker(runs):
    """TensorBoard mirrors each eval row's task scores (and their seconds) at its step."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(runs.w1 / "tensorboard"))
    events.Reload()
    evals = read_metrics(runs.w1)[1]
    for name in ("mine_acc_norm", "mine_acc", "hellaswag_acc_char", "hellaswag_n", "mine_s",
                 "train_s"):
        got = [(e.step, e.value) for e in events.Scalars(name)]
        assert got == [(r["step"], pytest.approx(r[name], rel=1e-6)) for r in evals], name


def test_eval_equals_llm_c_definition_at_w1_and_w2(runs):
    """The final checkpoint scored by `ddpgpt eval` on one and two processes, by the oracle,
    and by the training's own last evaluation (the same weights)."""
    args = ["eval", "--run-dir", runs.w1, "--task", "mine,hellaswag", "--task-data",
            f"{runs.files['mine']},{runs.files['hellaswag']}", "--json", "--device", "cpu"]
    one = json.loads(_ok(run_in_process(*args)).stdout)
    results = run_ranks([["-m", "ddpgpt", *map(str, args)]] * 2, runs.root / "eval-w2")
    two = json.loads(results[0].stdout)
    assert results[1].stdout == ""  # rank 0 alone prints
    assert _task_scores(one) == _task_scores(two) == _task_scores(read_metrics(runs.w1)[1][-1])
    assert one["val_loss"] == pytest.approx(two["val_loss"], abs=1e-6)
    model = _model(runs.w1)
    for name, rows in runs.rows.items():
        ref = oracle.accuracy(model, rows, lambda t: list(t.encode()), 32)
        assert (one[f"{name}_acc_norm"], one[f"{name}_acc"], one[f"{name}_n"]) == \
            (ref["acc_norm"], ref["acc"], ref["n"])


def test_target_val_loss_stops_with_a_checkpoint_a_row_and_a_line(runs):
    rows = runs.stopped_rows
    assert max(r["step"] for r in rows) == 4
    event = rows[-1]
    assert event["event"] == "target" and event["step"] == 4
    assert (event["val_loss"], event["target"], event["tokens"]) == (runs.val4, runs.val4, 4 * 256)
    assert 0 < event["train_s"] < event["elapsed_s"]
    assert f"reached val loss {runs.val4:g} ({runs.val4:.4f}) at step 4, " in runs.stopped.stderr
    assert "s training), 1,024 tokens" in runs.stopped.stderr
    assert [r for r in read_metrics(runs.w1)[1] if r["step"] == 2][0]["val_loss"] > runs.val4
    # The checkpoint of step 4 is the target's (run.checkpoint_every is 3).
    assert "resuming from" in runs.resumed.stderr and "step_0000004 (step 4," in \
        runs.resumed.stderr


def test_wsd_resumed_in_its_flat_phase_with_more_steps_stays_flat(runs):
    """8 steps with the last quarter decaying (from step index 6), stopped at step 4, resumed
    with 12: flat at the peak on to index 8, then down to min_lr at the new end."""
    lrs = {r["step"]: r["lr"] for r in read_metrics(runs.target)[0]}
    assert sorted(lrs) == list(range(1, 13))
    assert [lrs[s] for s in (1, 2)] == [5e-3, 1e-2]  # warmup, not repeated after the resume
    assert [lrs[s] for s in range(3, 10)] == [1e-2] * 7  # rows of steps 5-9: no jump, no decay
    assert lrs[10] < 1e-2 and lrs[12] == 1e-3  # a tenth of optim.lr: min_lr unset
    config = json.loads((runs.target / "config.json").read_text())
    assert config["optim"]["decay_steps"] == 12
    cfg = from_dict(config).optim
    assert [lrs[s] for s in range(1, 13)] == [lr_at(k, cfg, 12) for k in range(12)]


def test_an_export_scores_the_same_in_transformers_and_lm_eval(runs):
    transformers = pytest.importorskip("transformers")
    out = runs.root / "hf"
    _ok(run_in_process("export", "--run-dir", runs.w1, "--out", out))
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()  # the default arch: Qwen3
    assert type(hf).__name__ == "Qwen3ForCausalLM"
    model, tok = _model(runs.w1), ByteTokenizer()
    task = tasks.load("mine", str(runs.files["mine"]))
    for example in task.examples:
        r = render(example, tok, 32)
        ours, _ = ending_losses(model, r, torch.device("cpu"))
        with torch.no_grad():
            logits = hf(r.inputs).logits.float()
        theirs = torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), r.targets.flatten(), ignore_index=-1,
            reduction="none").view(r.targets.shape).double().sum(1)
        assert ours.tolist() == pytest.approx(theirs.tolist(), abs=1e-5)
    pytest.importorskip("lm_eval", reason="lm-evaluation-harness: pip install 'ddpgpt[eval]'")
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    lm = HFLM(pretrained=str(out), device="cpu", batch_size=1, dtype="float32")
    pairs = [("a man is", "sitting on"), ("the dog", "runs"), ("then she", "holding cube"),
             ("he starts pulling", "up the roof")]
    got = lm.loglikelihood([Instance("loglikelihood", {}, (c, " " + e), i)
                            for i, (c, e) in enumerate(pairs)])
    for (ctx, end), (loglik, _) in zip(pairs, got):
        ours, _ = ending_losses(model, render(Example(ctx, (end, end), 0), tok, 32),
                                torch.device("cpu"))
        assert loglik == pytest.approx(-ours[0].item(), abs=1e-4)


def test_a_bad_task_file_is_one_line_in_eval_and_train(runs, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"ctx": "a", "endings": ["b", "c"], "label": 0}\n'
                   '{"ctx": "a", "endings": ["b", "c"], "label": 5}\n')
    line = f"ddpgpt: error: {bad}:2: label 5 is not an index into the 2 endings (0 to 1)"
    r = run_in_process("eval", "--run-dir", runs.w1, "--task", "piqa", "--task-data", bad)
    assert r.returncode == 2 and r.stderr.startswith(line) and r.stderr.count("\n") == 1
    run = tmp_path / "never"
    for nproc in ([], ["--nproc", "2"]):  # the launcher checks it before starting any worker
        r = run_in_process(*tiny_train_args(runs.data, run, run__eval_tasks="piqa",
                                            run__eval_task_data=bad)[2:], *nproc)
        assert r.returncode == 2 and r.stderr.startswith(line) and r.stderr.count("\n") == 1
        assert not run.exists()  # refused before anything is written

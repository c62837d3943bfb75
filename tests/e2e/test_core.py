"""CORE through the real command line, on the tests' bundle (tests/core_bundle.py): scored during
training (metrics.jsonl, the progress line, `ddpgpt plot`), by `ddpgpt eval` at W=1 and W=2 with
the same figures, equal to the independent implementation (tests/core_oracle.py) scoring the
run's `ddpgpt export` through transformers; `eval --init-from` a transformers directory (the
export, a GPT-2, a Llama) equal to the same oracle on that directory; bad input as one line.

One W=1 training (4 steps, CORE and a checkpoint at steps 2 and 4, 8 examples a task) and its
export are shared by the module's tests."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from ddpgpt import cli
from ddpgpt.commands.plot import load_run, task_names
from ddpgpt.evals.kinds import label_of
from tests import core_oracle as oracle
from tests.core_bundle import write_bundle
from tests.helpers import TIKTOKEN_GPT2, read_metrics, tiny_train_args
from tests.in_process import run_in_process
from tests.processes import run_ranks

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]
transformers = pytest.importorskip("transformers")
LABELS = ("mc", "wino", "lm")


def _ok(r):
    assert r.returncode == 0, r.stderr
    return r


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_data):
    root = tmp_path_factory.mktemp("core")
    bundle = write_bundle(root, n=12)
    run_dir, hf = root / "run", root / "hf"
    trained = _ok(run_in_process(*tiny_train_args(
        tiny_data, run_dir, steps=4, run__eval_every=2, run__checkpoint_every=2,
        run__eval_tasks="core", run__eval_task_data=bundle, run__eval_core_limit=8,
        model__vocab_size=257)[2:]))
    _ok(run_in_process("export", "--run-dir", run_dir, "--out", hf))
    return SimpleNamespace(root=root, bundle=bundle, run=run_dir, hf=hf, trained=trained)


def _eval(*args, ranks: int = 1, workdir: Path | None = None) -> dict:
    """`ddpgpt eval ARGS --json` on `ranks` processes: rank 0's object."""
    argv = ["eval", *map(str, args), "--json", "--device", "cpu"]
    if ranks == 1:
        return json.loads(_ok(run_in_process(*argv)).stdout)
    results = run_ranks([["-m", "ddpgpt", *argv]] * ranks, workdir, timeout=180)
    assert all(r.stdout == "" for r in results[1:])  # rank 0 alone prints
    return json.loads(results[0].stdout)


def _core(scores: dict) -> dict:
    return {k: v for k, v in scores.items() if k.startswith("core_")}


def _transformers(directory: Path, bundle: Path, encode=None) -> dict:
    """The oracle on a transformers directory: its model's logits, its tokenizer (or `encode`),
    its config's BOS and positions."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(directory)).eval()
    if encode is None:
        tok = transformers.AutoTokenizer.from_pretrained(str(directory))
        encode = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    block = getattr(hf.config, "n_positions", None) or hf.config.max_position_embeddings
    return oracle.score(lambda ids: hf(torch.tensor([ids])).logits[0], encode,
                        hf.config.bos_token_id, block, bundle)


def _assert_equal(scores: dict, ref: dict) -> None:
    assert scores["core_metric"] == pytest.approx(ref["core"], abs=1e-12)
    for label in LABELS:
        assert (scores[f"core_{label}_acc"], scores[f"core_{label}_centered"]) == \
            pytest.approx(ref[label], abs=1e-12), label


def test_core_is_scored_during_training_and_shown(run):
    rows = read_metrics(run.run)[1]
    assert [r["step"] for r in rows] == [2, 4]
    for r in rows:
        assert r["core_n"] == 24 and r["core_s"] > 0
        assert [r[f"core_{label}_n"] for label in LABELS] == [8, 8, 8]
        assert f"train_eval_loss {r['train_eval_loss']:.4f}, core {r['core_metric']:.4f}\n" in \
            run.trained.stdout, run.trained.stdout
        centered = [r[f"core_{label}_centered"] for label in LABELS]
        assert r["core_metric"] == pytest.approx(sum(centered) / 3, abs=1e-12)
    assert task_names([load_run(run.run)]) == {"core": "core_metric"}
    assert label_of("core", "core_metric") == "CORE (centered accuracy, nanochat's)"
    # The first evaluation's weights are step 2's checkpoint: eval --step 2 with the same cap
    # agrees (the newest checkpoint's, step 4's, score otherwise).
    again = _eval("--run-dir", run.run, "--step", 2, "--task", "core", "--task-data",
                  run.bundle, "--limit", 8)
    assert again["step"] == 2
    assert _core(again) == {k: v for k, v in _core(rows[0]).items() if k != "core_s"}


def test_eval_at_w1_and_w2_equals_the_oracle_on_the_export(run):
    args = ("--run-dir", run.run, "--task", "core", "--task-data", run.bundle)
    one = _eval(*args)
    two = _eval(*args, ranks=2, workdir=run.root / "eval-w2")
    assert _core(one) == _core(two) and one["core_n"] == 36
    _assert_equal(one, _transformers(run.hf, run.bundle))


def test_eval_prints_core_and_a_line_per_task(run):
    out = _ok(run_in_process("eval", "--run-dir", run.run, "--task", "core", "--task-data",
                             run.bundle, "--device", "cpu")).stdout.splitlines()
    at = next(i for i, line in enumerate(out) if line.startswith("core: "))
    assert re.fullmatch(rf"core: metric -?\d\.\d{{4}} \(36 examples of {run.bundle}, "
                        r"\d+\.\d s\)", out[at])
    shown = [re.fullmatch(r"  (\w+): acc (\d\.\d{4}), centered (-?\d\.\d{4}) \(12 examples, "
                          r"(\d)-shot (\w+)\)", line) for line in out[at + 1:at + 4]]
    assert [(m[1], m[4], m[5]) for m in shown] == [
        ("mc", "2", "multiple_choice"), ("wino", "1", "schema"), ("lm", "3", "language_modeling")]


def test_init_from_the_export_scores_what_the_run_scores(run):
    scores = _eval("--init-from", run.hf, "--task", "core", "--task-data", run.bundle)
    assert scores["init_from"] == str(run.hf) and "val_loss" not in scores
    _assert_equal(scores, _transformers(run.hf, run.bundle))


def test_init_from_a_gpt2_directory_with_a_short_block(tmp_path, run):
    """GPT-2's layout, no tokenizer files (GPT-2's ids: tiktoken), 40 positions: every few-shot
    prompt is cut to its last 40 tokens."""
    if not TIKTOKEN_GPT2.is_dir():
        pytest.skip("no offline copy of GPT-2's tiktoken files")
    tiktoken = pytest.importorskip("tiktoken")
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_head=2, n_embd=32, n_positions=40, vocab_size=50257))
    with torch.no_grad():
        hf.transformer.wte.weight.normal_(0, 0.5)  # choices far apart, no near ties
    hf.save_pretrained(str(tmp_path / "gpt2"))
    r = _ok(run_in_process("eval", "--init-from", tmp_path / "gpt2", "--task", "core",
                           "--task-data", run.bundle, "--json", "--device", "cpu"))
    assert "their 50,257 ids taken for GPT-2's" in r.stderr
    encode = tiktoken.get_encoding("gpt2").encode_ordinary
    _assert_equal(json.loads(r.stdout), _transformers(tmp_path / "gpt2", run.bundle, encode))


def test_init_from_a_llama_directory_starts_with_its_bos(tmp_path, run):
    """LlamaForCausalLM with a byte-level tokenizer.json and bos_token_id 10 (not its
    <|endoftext|>): the prompts start with 10 (the scorer prepends the tokenizer's eot_id:
    tests/unit/test_core.py's model that knows the answers finds them only after it)."""
    from ddpgpt.commands.export import byte_tokenizer
    from ddpgpt.hf import pretrained

    torch.manual_seed(1)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=257, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
        bos_token_id=10, eos_token_id=256, tie_word_embeddings=False))
    with torch.no_grad():
        hf.model.embed_tokens.weight.normal_(0, 1.0)
    hf.save_pretrained(str(tmp_path / "llama"))
    transformers.PreTrainedTokenizerFast(tokenizer_object=byte_tokenizer()).save_pretrained(
        str(tmp_path / "llama"))
    assert pretrained.load(str(tmp_path / "llama")).tokenizer.eot_id == 10
    scores = _eval("--init-from", tmp_path / "llama", "--task", "core", "--task-data",
                   run.bundle)
    _assert_equal(scores, _transformers(tmp_path / "llama", run.bundle))


def _fails(capsys, *argv) -> str:
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        cli.main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1, err
    return err.removeprefix("ddpgpt: error: ").rstrip("\n")


def test_bad_input_is_one_line(run, tiny_data, tmp_path, capsys):
    evaluate = ["eval", "--run-dir", run.run, "--device", "cpu"]
    assert _fails(capsys, *evaluate, "--task", "core") == (
        "--task core: give its eval bundle directory (core.yaml, eval_meta_data.csv, "
        "eval_data/) with --task-data DIR")
    assert _fails(capsys, *evaluate, "--task", "core", "--task-data", run.bundle, "--limit",
                  2) == (f"{run.bundle / 'core.yaml'}: icl_tasks entry 1: mc is 2-shot but has "
                         "2 example(s) (the first 2 kept): each needs 2 others; give at least 3 "
                         "(a larger limit) or lower its num_fewshot")
    assert _fails(capsys, *evaluate, "--step", 3) == (
        f"run {run.run} has no checkpoint at step 3 (it has: 2, 4); give one of those, or leave "
        "--step out for the newest")
    assert _fails(capsys, "eval", "--init-from", run.hf, "--task", "core", "--step", 2) == (
        f"invalid config: --step 2 picks a checkpoint of a run; --init-from {run.hf} has none "
        "(its weights are the model): drop --step")
    assert _fails(capsys, "eval", "--init-from", run.hf) == (
        f"invalid config: --init-from {run.hf} scores tasks only (no dataset, no validation "
        "loss): give --task (core, hellaswag, ...)")
    assert _fails(capsys, *evaluate, "--init-from", run.hf, "--task", "core") == (
        f"invalid config: --init-from {run.hf} and --run-dir {run.run}: give one, the model "
        "to score")
    assert _fails(capsys, "eval", "--init-from", run.hf, "--task", "core", "--data",
                  str(tiny_data)) == (f"invalid config: --data {tiny_data} is a run's "
                                      "validation data; --init-from scores tasks only")
    never = tmp_path / "never"
    assert _fails(capsys, *tiny_train_args(tiny_data, never, run__eval_tasks="core",
                                           run__eval_task_data=run.bundle,
                                           run__eval_core_limit=3)[2:]).startswith(
        f"{run.bundle / 'core.yaml'}: icl_tasks entry 3: lm is 3-shot but has 3 example(s)")
    assert not never.exists()  # refused before anything is written

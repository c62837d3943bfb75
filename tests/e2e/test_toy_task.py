"""A new kind of eval task is its file and its row: tests/e2e/toy_task.py adds both from outside
the package, and a task of that kind is scored during training (metrics.jsonl's eval rows, the
progress line) and by `ddpgpt eval` at W=1 and W=2, equal to the same definition computed here
on the checkpoint's model; `ddpgpt plot` finds its headline score."""

import json
import re

import pytest
import torch
import torch.nn.functional as F

from ddpgpt.checkpoint.read import load_latest
from ddpgpt.commands.plot import load_run, task_names
from ddpgpt.config.io import from_dict
from ddpgpt.data.tokenizer import ByteTokenizer
from ddpgpt.errors import UserError
from ddpgpt.evals import tasks
from ddpgpt.evals.kinds import KINDS, label_of
from ddpgpt.model.gpt import GPT
from tests.e2e import toy_task
from tests.helpers import REPO, read_metrics, tiny_train_args
from tests.processes import run_ranks

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]
TEXTS = ["def f(x):\n    return x + 1\n", "import os\nprint(os.getcwd())\n",
         "for i in range(10):\n    total += i\n", "class A:\n    pass\n",
         "while True:\n    break\n"]


def toy(*args: str) -> list[str]:
    return ["-m", "tests.e2e.toy_task", *map(str, args)]


def oracle(run_dir) -> float:
    """Mean cross-entropy per token over the texts, on one process, from the checkpoint."""
    _, meta, state = load_latest(run_dir / "checkpoints")
    cfg = from_dict(meta["config"])
    model = GPT(cfg.model).eval()
    model.load_state_dict(state["model"])
    total, count = 0.0, 0
    with torch.no_grad():
        for text in TEXTS:
            ids = list(text.encode())[-(cfg.model.block_size + 1):]
            logits, _ = model(torch.tensor([ids[:-1]]))
            total += F.cross_entropy(logits[0], torch.tensor(ids[1:]), reduction="sum").item()
            count += len(ids) - 1
    return total / count


def test_a_task_kind_added_from_outside_is_scored_like_a_built_in_one(tmp_path, tiny_data,
                                                                     monkeypatch):
    file, run_dir = tmp_path / "mine.jsonl", tmp_path / "run"
    file.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    args = tiny_train_args(tiny_data, run_dir, steps=4, run__eval_every=2,
                           run__eval_tasks="toy:mine", run__eval_task_data=file)
    (trained,) = run_ranks([toy(*args[2:])], tmp_path / "train", timeout=200)
    rows = read_metrics(run_dir)[1]
    assert [r["step"] for r in rows] == [2, 4]
    for r in rows:
        assert r["mine_n"] == len(TEXTS) and r["mine_s"] > 0
        line = (f"step {r['step']}: val_loss {r['val_loss']:.4f}, val_bpb {r['val_bpb']:.4f}, "
                f"train_eval_loss {r['train_eval_loss']:.4f}, ")
        assert f"{line}mine {r['mine_nll']:.4f}\n" in trained.stdout, trained.stdout
    want = oracle(run_dir)
    assert rows[-1]["mine_nll"] == pytest.approx(want, rel=1e-6)

    flags = ["--run-dir", run_dir, "--task", "toy:mine", "--task-data", file, "--device", "cpu"]
    (one,) = run_ranks([toy("eval", *flags)], tmp_path / "eval1", timeout=120)
    line = next(x for x in one.stdout.splitlines() if x.startswith("mine: "))
    assert re.fullmatch(rf"mine: nll {want:.4f} \(5 examples of {file}, \d+\.\d s\)", line)
    two = run_ranks([toy("eval", *flags, "--json")] * 2, tmp_path / "eval2", timeout=120)
    scores = json.loads(two[0].stdout.splitlines()[-1])
    assert scores["mine_nll"] == pytest.approx(want, rel=1e-6) and scores["mine_n"] == 5

    monkeypatch.setitem(KINDS, "toy", toy_task.ROW)
    assert task_names([load_run(run_dir)]) == {"mine": "mine_nll"}
    assert label_of("mine", "mine_nll") == "mean loss per token"


def test_a_task_of_an_unknown_kind_is_one_line(monkeypatch):
    with pytest.raises(UserError, match=r"^--task tox:mine: unknown task kind 'tox' \(did you "
                                        r"mean toy\?\); choose one of multiple_choice, chat, "
                                        r"core, toy "):
        monkeypatch.setitem(KINDS, "toy", toy_task.ROW)
        tasks.pairs("tox:mine", "m.jsonl", "--task", "--task-data")


def test_the_toy_kind_reads_its_own_lines(tmp_path, monkeypatch):
    monkeypatch.setitem(KINDS, "toy", toy_task.ROW)
    path = tmp_path / "t.jsonl"
    path.write_text('{"text": "ab"}\n{"ctx": "a"}\n')
    with pytest.raises(UserError, match=rf'^{path}:2: each line must be {{"text": "..."}}$'):
        tasks.load("toy:t", str(path))
    path.write_text('{"text": "ab"}\n')
    task = tasks.load("toy:t", str(path))
    assert (task.name, task.kind, task.examples) == ("t", "toy", ("ab",))
    assert toy_task.token_rows(task.examples, ByteTokenizer(), 4) == [[97, 98]]


def test_the_package_does_not_know_the_toy_kind():
    """Nothing under ddpgpt/ names it: the file and the row are all there is."""
    assert not [p for p in (REPO / "ddpgpt").rglob("*.py") if "toy" in p.read_text()]

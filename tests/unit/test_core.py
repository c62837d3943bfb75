"""CORE (evals/bundle.py, evals/core.py) on the tests' own bundle (tests/core_bundle.py): the
prompts' exact text, nanochat's shuffle and shot draws, each example's outcome against an
independent implementation (tests/core_oracle.py) with each tokenizer and rows longer than the
block, a model that knows the answers scoring 1, one that ties every choice scoring its baseline
(centered 0), and every bad bundle as one line."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest
import torch

from ddpgpt.config.model import ModelConfig
from ddpgpt.data.tokenizer import ByteTokenizer, GPT2Tokenizer
from ddpgpt.distributed.group import DistEnv
from ddpgpt.errors import DataError, UserError
from ddpgpt.evals import bundle, core, kinds, tasks
from ddpgpt.evals.scorer import Scorer
from ddpgpt.model.gpt import GPT
from tests import core_oracle as oracle
from tests.core_bundle import write_bundle
from tests.helpers import TIKTOKEN_GPT2

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def small(tmp_path) -> Path:
    return write_bundle(tmp_path, n=6, seed=1)


@pytest.fixture(scope="module")
def twelve(tmp_path_factory) -> Path:
    return write_bundle(tmp_path_factory.mktemp("core"), n=12)


def test_prompts_are_the_shots_then_the_example(small):
    """Example 1 of each task after nanochat's shuffle: its shots (solved, each then a blank
    line), then the example once per choice or option; language modeling's context stripped,
    the prompt without the continuation stripped at its end."""
    mc, wino, lm = bundle.read(small)
    shots = ("Question 5: what comes after laser honey window?\nAnswer: music\n\n"
             "Question 4: what comes after planet river winter?\nAnswer: honey\n\n")
    assert bundle.prompts(mc, 1) == [
        f"{shots}Question 0: what comes after green planet stone?\nAnswer: {choice}"
        for choice in ("cloud winter", "winter honey", "cloud", "apple honey")]
    assert bundle.prompts(wino, 1) == [
        "A window planet met case 5 and then it was orange paper.\n\n"
        f"{option} case 0 and then it was paper orange." for option in ("The laser saw",
                                                                        "A seven apple met")]
    first = ("copy 5: apple garden => quiet\n\ncopy 4: quiet river => stone\n\n"
             "copy 3: planet tiger => orange\n\ncopy 0: laser silver =>")
    assert bundle.prompts(lm, 1) == [first, first + " window silver"]
    rows = [json.loads(line) for line in (small / "eval_data/symbolic/lm.jsonl").open()]
    assert rows[0]["context"] == " copy 0: laser silver  "  # stripped in the prompt


def test_the_order_and_the_shots_are_nanochats(small):
    """Each task's examples in random.Random(1337)'s shuffle of the file, capped after it; each
    example's shots drawn by random.Random(1234 + i).sample from the list of the others."""
    lines = [json.loads(line) for line in (small / "eval_data/knowledge/mc.jsonl").open()]
    random.Random(1337).shuffle(lines)
    for limit in (0, 4):
        mc = bundle.read(small, limit)[0]
        assert [e.query for e in mc.examples] == [r["query"] for r in lines][:limit or None]
    for n, k in ((4, 3), (12, 2), (86, 10), (500, 10), (10042, 10), (10042, 3)):
        for i in (0, 1, n // 2, n - 1):
            others = [j for j in range(n) if j != i]
            assert bundle.shots(n, i, k) == random.Random(1234 + i).sample(others, k), (n, i, k)


def _tokenizer(kind: str, monkeypatch):
    if kind == "byte":
        return ByteTokenizer(), lambda text: list(text.encode())
    pytest.importorskip("tiktoken")
    if not TIKTOKEN_GPT2.is_dir():
        pytest.skip("no offline copy of GPT-2's tiktoken files")
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(TIKTOKEN_GPT2))
    tok = GPT2Tokenizer()
    return tok, tok._enc.encode_ordinary  # tiktoken itself, not ddpgpt's encode_batch


@pytest.mark.parametrize("kind,block", [("byte", 64), ("byte", 1024), ("gpt2", 24),
                                        ("gpt2", 256)])
def test_each_outcome_equals_the_independent_implementation(twelve, monkeypatch, kind, block):
    """Every example's right-or-wrong, a seeded model's, as the oracle finds it; block 64 and
    24 cut most rows to their last tokens (GPT-2's tokens: choices that share a prefix token)."""
    tok, encode = _tokenizer(kind, monkeypatch)
    model = GPT(ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=block,
                            vocab_size=tok.vocab_size), seed=3).eval()
    ours = {p.label: [core.correct(model, r, block, torch.device("cpu"))
                      for r in core.render(p, range(len(p.examples)), tok, block)]
            for p in bundle.read(twelve)}
    ref = oracle.score(lambda ids: model(torch.tensor([ids]))[0][0], encode, tok.eot_id, block,
                       twelve)
    assert ours == ref["outcomes"]
    task = tasks.load("core", str(twelve))
    scores = Scorer([task], tok, block, DistEnv()).score(model)
    assert scores["core_metric"] == pytest.approx(ref["core"], abs=1e-12)
    for label in ("mc", "wino", "lm"):
        assert (scores[f"core_{label}_acc"], scores[f"core_{label}_centered"]) == \
            pytest.approx(ref[label], abs=1e-12)
        assert scores[f"core_{label}_n"] == 12
    assert scores["core_n"] == 36 and scores["core_s"] > 0


class Knows(torch.nn.Module):
    """A model that has read the solved prompts' answers: after a prefix of one it has seen that
    ends at or past the answer's first token (`starts`: where each row's answer begins), the
    next token scores 30, every other token 0; after anything else, all tie."""

    def __init__(self, rows: list[list[int]], vocab: int, starts: list[int] | None = None):
        super().__init__()
        self.vocab, self.next = vocab, {}
        for row, start in zip(rows, starts or [1] * len(rows)):
            for t in range(start, len(row)):
                self.next.setdefault(tuple(row[:t]), row[t])

    def forward(self, idx):
        logits = torch.zeros(*idx.shape, self.vocab)
        for b, row in enumerate(idx.tolist()):
            for t in range(len(row)):
                if (nxt := self.next.get(tuple(row[:t + 1]))) is not None:
                    logits[b, t, nxt] = 30.0
        return logits, None


def _solved(bundle_dir: Path, tok) -> tuple[list[list[int]], list[int]]:
    """Each example's right prompt as tokens (the oracle's text), and where its answer starts:
    after the choices' shared prefix, before the options' shared suffix, after the prompt
    without the continuation."""
    rows, starts = [], []
    for task in oracle.read(bundle_dir):
        for i, item in enumerate(task["data"]):
            ids = [[tok.eot_id, *t.encode()] for t in oracle.texts(task, task["data"], i)]
            if task["type"] == "language_modeling":
                rows.append(ids[1])
                starts.append(len(ids[0]))
                continue
            rows.append(ids[item["gold"]])
            if task["type"] == "multiple_choice":
                starts.append(oracle._prefix(ids))
            else:
                starts.append(len(rows[-1]) - oracle._prefix([r[::-1] for r in ids]))
    return rows, starts


def test_a_model_that_knows_the_answers_scores_1_and_chance_scores_0(twelve):
    tok = ByteTokenizer()
    rows, starts = _solved(twelve, tok)
    scorer = Scorer([tasks.load("core", str(twelve))], tok, 4096, DistEnv())
    for model in (Knows(rows, tok.vocab_size), Knows(rows, tok.vocab_size, starts)):
        scores = scorer.score(model)  # knowing the whole prompts, or only the answers' tokens
        for label in ("mc", "wino", "lm"):
            assert scores[f"core_{label}_acc"] == scores[f"core_{label}_centered"] == 1.0
        assert scores["core_metric"] == 1.0
    # One token short of the answer: language modeling wants every continuation token.
    scores = scorer.score(Knows(rows, tok.vocab_size, [s + 1 for s in starts]))
    assert scores["core_lm_acc"] == 0 and scores["core_mc_acc"] == 1
    # Every choice tied: the first wins, right on i % choices of them: each task's baseline.
    scores = scorer.score(Knows([], tok.vocab_size))
    assert [scores[f"core_{label}_acc"] for label in ("mc", "wino", "lm")] == [0.25, 0.5, 0.0]
    assert [scores[f"core_{label}_centered"] for label in ("mc", "wino", "lm")] == [0, 0, 0]
    assert scores["core_metric"] == 0.0


def test_centered_scores_chance_as_0_and_all_right_as_1():
    assert [core.centered(0.25, 25), core.centered(1.0, 25), core.centered(0.0, 0)] == [0, 1, 0]
    assert core.centered(0.5, 50) == 0 and core.centered(0.75, 50) == 0.5
    assert core.centered(0.2, 25) == pytest.approx(-1 / 15)


def test_an_example_with_a_choice_without_tokens_of_its_own_is_wrong():
    """Choice "a" is a prefix of "a b": none of its tokens are its own, so no mean compares it
    with the other and the example is wrong, whichever is gold and whatever the model (a gold
    "a b" used to win against a model that ties everything: right without any model)."""
    tok = ByteTokenizer()
    for gold in (0, 1):
        part = bundle.Part("t", "multiple_choice", 0, " ", 25.0, "t.jsonl",
                           (bundle.Question("q", ("a", "a b"), gold),))
        (r,) = core.render(part, [0], tok, 64)
        assert [len(t) for t in r.tails] == [0, 2]
        knows = Knows([[tok.eot_id, *bundle.prompts(part, 0)[gold].encode()]], 257)
        for model in (Knows([], 257), knows):
            assert not core.correct(model, r, 64, torch.device("cpu")), gold


def test_alike_choices_besides_the_answer_read(small):
    """ARC has examples with two choices alike, neither of them gold: the model can still tell
    the answer from them, so they read (the alike ones tie, the first of them stands)."""
    path = small / "eval_data/knowledge/mc.jsonl"
    path.write_text(path.read_text() + '{"query": "q", "choices": ["no", "no", "yes"], '
                    '"gold": 2}\n')
    examples = bundle.read(small)[0].examples
    assert bundle.Question("q", ("no", "no", "yes"), 2) in examples and len(examples) == 7


def test_core_alone_names_the_bundle_and_needs_its_directory():
    assert kinds.split("core", "--task") == ("core", "core")
    assert kinds.split("core:mini", "--task") == ("core", "mini")
    assert kinds.split("piqa", "--task") == ("multiple_choice", "piqa")
    with pytest.raises(UserError, match=r"^--task core: give its eval bundle directory \("
                                        r"core.yaml, eval_meta_data.csv, eval_data/\) with "
                                        r"--task-data DIR$"):
        tasks.pairs("core", "", "--task", "--task-data")


def test_too_few_examples_for_the_shots_is_one_line(small):
    with pytest.raises(DataError) as e:
        bundle.read(small, limit=3)
    assert str(e.value) == (f"{small / 'core.yaml'}: icl_tasks entry 3: lm is 3-shot but has 3 "
                            "example(s) (the first 3 kept): each needs 3 others; give at least "
                            "4 (a larger limit) or lower its num_fewshot")
    (small / "eval_data/symbolic/lm.jsonl").write_text('{"context": "a", "continuation": "b"}\n')
    with pytest.raises(DataError, match=r"lm is 3-shot but has 1 example\(s\): each needs"):
        bundle.read(small)


BAD_LINES = [
    ("knowledge/mc.jsonl", '{"query": "q", "choices": ["a", "b"], "gold": 2}',
     "gold 2 is not an index into the 2 choices; each line of a multiple_choice task must be "
     '{"query": ..., "choices": [...], "gold": INDEX}'),
    ("knowledge/mc.jsonl", '{"query": "q", "choices": ["a"], "gold": 0}',
     "choices must be a list of at least 2 strings"),
    ("language/wino.jsonl", '{"context_options": ["a", "b"], "gold": 0}',
     "missing field continuation; each line of a schema task must be"),
    ("symbolic/lm.jsonl", '{"context": "a", "continuation": " "}',
     "continuation is empty (it is what is scored)"),
    ("symbolic/lm.jsonl", '{"context": 3, "continuation": "b"}', "context is a int, not a string"),
    ("symbolic/lm.jsonl", "[1, 2]", "a JSON list, not an object"),
    # the same rows for the gold answer and another: the tie rule would decide, not the model
    *[("knowledge/mc.jsonl", f'{{"query": "q", "choices": ["yes", "yes"], "gold": {gold}}}',
       "choices 0 and 1 are the same text ('yes'), one of them gold: no model can tell the "
       "answer from the other; make each choice its own text, or drop the line")
      for gold in (0, 1)],
    ("language/wino.jsonl", '{"context_options": ["a", "b", "a"], "continuation": "c", '
     '"gold": 2}', "context_options 0 and 2 are the same text ('a'), one of them gold: no "
     "model can tell the answer from the other; make each option its own text, or drop the "
     "line"),
]


@pytest.mark.parametrize("file,line,what", BAD_LINES)
def test_a_bad_line_is_named_by_its_file_and_line(small, file, line, what):
    path = small / "eval_data" / file
    path.write_text(path.read_text() + line + "\n")
    with pytest.raises(DataError) as e:
        bundle.read(small)
    assert str(e.value).startswith(f"{path}:7: {what}") and "\n" not in str(e.value)


@pytest.mark.parametrize("change,what", [
    (lambda b: (b / "core.yaml").unlink(), "{b}: no core.yaml there; give the eval bundle's "
                                           "directory (core.yaml, eval_meta_data.csv, eval_data/;"
                                           " nanochat's: https://karpathy-public.s3.us-west-2."
                                           "amazonaws.com/eval_bundle.zip, unzipped)"),
    (lambda b: (b / "core.yaml").write_text("icl_tasks: [\n"), "{b}/core.yaml: not YAML ("),
    (lambda b: None, "{b}/core.yaml: a file, not a directory; give the eval bundle's directory"),
    (lambda b: (b / "core.yaml").write_text("tasks: []\n"), "{b}/core.yaml: no icl_tasks list"),
    (lambda b: _yaml(b, "icl_task_type: schema", "icl_task_type: question_answering"),
     "{b}/core.yaml: icl_tasks entry 2: wino has icl_task_type 'question_answering'; CORE's "
     "are multiple_choice, schema, language_modeling"),
    (lambda b: _yaml(b, "label: lm", "label: mc"), "{b}/core.yaml: icl_tasks entry 3: label "
                                                   "'mc' is there twice"),
    (lambda b: _yaml(b, "label: lm", "label: lm2"), "{b}/eval_meta_data.csv: no row for 'lm2'"),
    (lambda b: _yaml(b, "symbolic/lm.jsonl", "symbolic/nope.jsonl"),
     "{b}/eval_data/symbolic/nope.jsonl: no such file (core.yaml's dataset_uri"),
    (lambda b: (b / "eval_meta_data.csv").write_text("Eval Task,Random baseline\nmc,x\n"),
     "{b}/eval_meta_data.csv:2: Random baseline 'x' is not a number (percent)"),
    (lambda b: _csv(b, "mc,25", "wino,50", "mc,25", "lm,0"),
     "{b}/eval_meta_data.csv:4: a second row for 'mc' (the first is line 2); keep one row a "
     "task"),
    (lambda b: _csv(b, "mc,0.25", "wino,0.5", "lm,0"),
     "{b}/eval_meta_data.csv: every Random baseline is 1 or less (mc 0.25, wino 0.5): "
     "fractions, where the column is in percent (25 for one chance in four); write each "
     "times 100"),
    (lambda b: _csv(b, "mc,0.25", "wino,50", "lm,0"),
     "{b}/eval_meta_data.csv:2: mc's Random baseline 0.25 is 0.25 percent, but its examples "
     "have at most 4 choices (chance 25 percent or more): the column is in percent; write 25 "
     "for a chance of 0.25"),
    (lambda b: _csv(b, "mc,25", "wino,0.5", "lm,0"),
     "{b}/eval_meta_data.csv:3: wino's Random baseline 0.5 is 0.5 percent, but its examples "
     "have at most 2 context options (chance 50 percent or more): the column is in percent; "
     "write 50 for a chance of 0.5"),
    (lambda b: (b / "eval_meta_data.csv").write_text("Task,Baseline\nmc,25\n"),
     "{b}/eval_meta_data.csv: no 'Eval Task' and 'Random baseline' columns (its header: Task, "
     "Baseline)"),
])
def test_a_bad_bundle_is_one_line(small, change, what):
    change(small)
    given = small / "core.yaml" if "a file, not" in what else small  # a file for the bundle
    with pytest.raises(DataError) as e:
        tasks.load("core", str(given))
    assert str(e.value).startswith(what.format(b=small)) and "\n" not in str(e.value)


def _yaml(b: Path, old: str, new: str) -> None:
    text = (b / "core.yaml").read_text()
    (b / "core.yaml").write_text(text.replace(old, new))


def _csv(b: Path, *rows: str) -> None:
    (b / "eval_meta_data.csv").write_text("Eval Task,Random baseline\n" + "\n".join(rows) + "\n")


def test_the_csv_reads_with_a_byte_order_mark(small):
    """A spreadsheet's UTF-8 export starts with a byte order mark (it once hid the 'Eval Task'
    column); the baselines read as without it."""
    path = small / "eval_meta_data.csv"
    path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())
    assert [(p.label, p.baseline) for p in bundle.read(small)] == [("mc", 25), ("wino", 50),
                                                                   ("lm", 0)]


def test_the_bundle_docs_gpt2_md_writes_out_reads_as_it_says(tmp_path):
    """docs/gpt2.md's "Your own CORE tasks": its files (the fenced blocks that start with
    `# my_bundle/PATH`) read as the tasks it describes, and the rows and scored tokens it shows
    are the ones scored."""
    doc = (Path(__file__).parents[2] / "docs" / "gpt2.md").read_text()
    for block in re.findall(r"```\w*\n(# my_bundle/.*?)```", doc, re.S):
        name, text = block.split("\n", 1)
        (tmp_path / name[2:]).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name[2:]).write_text(text)
    capitals, pronouns, copy = bundle.read(tmp_path / "my_bundle")
    assert [(p.label, p.type, p.shots, p.delimiter, p.baseline, len(p.examples))
            for p in (capitals, pronouns, copy)] == [
        ("capitals", "multiple_choice", 1, "\nAnswer: ", 33.33, 2),
        ("pronouns", "schema", 0, " ", 50, 2), ("copy", "language_modeling", 1, " => ", 0, 2)]
    france = next(i for i, e in enumerate(capitals.examples) if "France" in e.query)
    red = next(i for i, e in enumerate(copy.examples) if e.context == "copy: red blue")
    for rows in (bundle.prompts(capitals, france)[0], bundle.prompts(copy, red)[1]):
        assert f"```text\n{rows}\n```" in doc
    assert "Answer: Lyon" in bundle.prompts(capitals, france)[1]
    first = next(i for i, e in enumerate(pronouns.examples) if e.continuation == "was too big.")
    assert bundle.prompts(pronouns, first) == [
        f"The trophy did not fit in the case because the {x} was too big." for x in
        ("trophy", "case")]
    tok = ByteTokenizer()
    scored = [[bytes(t.tolist()).decode() for t in r.tails] for r in (
        core.render(capitals, [france], tok, 4096) + core.render(pronouns, [first], tok, 4096) +
        core.render(copy, [red], tok, 4096))]
    assert scored == [["Paris", "Lyon", "Nice"], [" was too big."] * 2, [" red blue"]]


def test_the_benchmarks_stand_in_has_cores_shape(tmp_path):
    """benchmarks/bench_core.py's stand-in reads as a bundle of CORE's 22 tasks, each with its
    type, shots, delimiter and choices, as many examples as the cap of 500 scores."""
    from benchmarks.bench_core import CAP, STANDIN, standin

    parts = bundle.read(standin(tmp_path), CAP)
    assert [(p.label, p.type, p.shots, p.delimiter, len(p.examples)) for p in parts] == \
        [(t[0], t[1], t[2], t[3], min(t[5], CAP)) for t in STANDIN]
    assert len(parts) == 22 and sum(len(p.examples) for p in parts) == 9345
    for part, t in zip(parts, STANDIN):
        ex = part.examples[0]
        assert len(getattr(ex, "choices", getattr(ex, "options", [None]))) == t[4]

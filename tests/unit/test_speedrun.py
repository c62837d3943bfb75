"""benchmarks/speedrun.py's own parts: nanoGPT's checkpoint scored through ddpgpt's evaluator on
the same windows as a ddpgpt model, its log's step times, and time to target."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from benchmarks import levers, nanogpt, speedrun
from ddpgpt.config.model import ModelConfig
from ddpgpt.config.presets import get_preset
from ddpgpt.data.loader import EvalLoader
from ddpgpt.data.shards import TokenDataset
from ddpgpt.distributed.group import DistEnv
from ddpgpt.evals.loss import evaluate
from ddpgpt.model.gpt import GPT
from ddpgpt.optim.schedule import lr_at
from tests.helpers import write_dataset

pytestmark = pytest.mark.usefixtures("one_thread")

# A stand-in for nanoGPT's model.py with nanoGPT's interface: GPTConfig(**model_args), and
# forward(idx, targets) -> (logits, mean loss over the targets that are not -1).
FAKE_MODEL = '''
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ddpgpt.config.model import ModelConfig
from ddpgpt.model.gpt import GPT as Ours


@dataclass
class GPTConfig:
    block_size: int
    vocab_size: int
    n_layer: int
    n_head: int
    n_embd: int


class GPT(torch.nn.Module):
    def __init__(self, config):
        super().__init__()
        self.inner = Ours(ModelConfig(n_layer=config.n_layer, n_head=config.n_head,
                                      n_embd=config.n_embd, block_size=config.block_size,
                                      vocab_size=config.vocab_size))

    def forward(self, idx, targets=None):
        logits, _ = self.inner(idx)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1),
                               ignore_index=-1)
        return logits, loss
'''


def test_a_nanogpt_checkpoint_scores_as_the_same_weights_in_ddpgpt(tmp_path):
    """The same weights give the same val loss through both doors: the token-weighted mean over
    every window, padding rows (21 windows in batches of 16) not counted."""
    gen = np.random.default_rng(0)
    data = write_dataset(tmp_path / "d", gen.integers(0, 60, 2000),
                         gen.integers(0, 60, 21 * 16 + 1), vocab_size=60)
    args = {"block_size": 16, "vocab_size": 64, "n_layer": 2, "n_head": 2, "n_embd": 32}
    ours = GPT(ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64), seed=7)
    (tmp_path / "ng").mkdir()
    (tmp_path / "ng" / "model.py").write_text(FAKE_MODEL)
    state = {f"_orig_mod.inner.{k}": v for k, v in ours.state_dict().items()}  # as compiled
    torch.save({"model": state, "model_args": args}, tmp_path / "ckpt.pt")
    scored = nanogpt.score(tmp_path / "ng", tmp_path / "ckpt.pt", data, threads=1)
    loader = EvalLoader(TokenDataset(data), seq_len=16, micro_batch=16)
    assert len(loader.windows) == 21
    assert scored == pytest.approx(evaluate(ours, loader, DistEnv()), abs=1e-6)


def test_nanogpts_step_times_and_time_to_target():
    log = "\n".join(["tokens per iteration will be: 4,096", "step 0: train loss 5.5, val loss 5.5",
                     *[f"iter {i}: loss 2.0, time {100 + i}.50ms, mfu -100.00%" for i in range(3)],
                     "step 3: train loss 2.0, val loss 2.0", "iter 3: loss 2.0, time 900.00ms"])
    assert nanogpt.step_seconds(log, 3) == [0.1005, 0.1015, 0.1025]
    with pytest.raises(SystemExit, match="no time for step 4"):
        nanogpt.step_seconds(log, 5)
    evals = [(25, 2.5, 10.0), (50, 1.99, 20.0), (75, 1.9, 30.0)]
    assert speedrun.to_target(evals, 2.0) == (50, 20.0)
    assert speedrun.to_target(evals, 1.99) == (50, 20.0)  # at or below
    assert speedrun.to_target(evals, 1.5) is None
    assert speedrun.spread([3.0, 1.0, 5.0], ".1f") == "3.0 (1.0–5.0)"  # the mean, the range
    assert speedrun.spread([3.0], ".1f") == "3.0"


def test_the_paced_ratio_is_steps_times_the_per_step_ratio_of_the_same_rounds(tmp_path):
    """× nanoGPT's time, paced: each seed's steps to target × (the median over rounds of the
    recipe's s/step over nanoGPT's in the same round) / 500; the taking-turns ratio beside it is
    the seed's training seconds over its own nanoGPT run's."""
    from types import SimpleNamespace
    ng = [{"train_s": 200.0, "final_val": 2.0, "load": [1.0, 3.0]},
          {"train_s": 250.0, "final_val": 2.2, "load": [2.0, 2.0]}]
    outs = [{"evals": [(100, 2.2, 60.0), (125, 2.05, 75.0)], "steps": 200, "final_val": 1.9,
             "step_s": 0.6, "load": []},
            {"evals": [(100, 2.09, 50.0)], "steps": 200, "final_val": 1.8, "step_s": 0.5}]
    paced = {"nanogpt": [{"step_s": 0.5}, {"step_s": 1.0}, {"step_s": 0.4}],
             "speedrun": [{"step_s": 0.6}, {"step_s": 1.0}, {"step_s": 0.6}]}  # 1.2, 1.0, 1.5
    args = SimpleNamespace(threads=2, nproc=1, pace=3)
    lines, summary = speedrun.table("c", args, 2.1, ng, {"speedrun": outs}, paced)
    row = summary["recipes"]["speedrun"]
    assert row["to_target"] == [(125, 75.0), (100, 50.0)]
    assert row["ratio"] == pytest.approx([75.0 / 200.0, 50.0 / 250.0])
    assert row["paced_ratio"] == pytest.approx([125 * 1.2 / 500, 100 * 1.2 / 500])
    assert lines[3].startswith("| nanoGPT | 500 | 0.450 (0.400–0.500) | 225.0 (200.0–250.0) | 1 | "
                               "2.0 (2.0–2.0) |")
    assert lines[4].startswith("| ddpgpt speedrun | 112 (100–125) | 0.550 (0.500–0.600) |")
    assert "| 0.27 (0.24–0.30) | 1.8500 (1.8000–1.9000) (200) |" in lines[4]


def test_a_runs_step_seconds_come_from_its_per_step_rows(tmp_path):
    (tmp_path / "config.json").write_text('{"data": {"global_batch": 16, "seq_len": 256}}')
    rows = ['{"step": 1, "tokens_per_s": 4096.0}', '{"step": 2, "tokens_per_s": 8192.0}',
            '{"step": 2, "val_loss": 3.0, "train_s": 1.5, "tokens_per_s": 1.0}',
            '{"event": "x", "tokens_per_s": 1.0}']
    (tmp_path / "metrics.jsonl").write_text("\n".join(rows) + "\n")
    assert speedrun.step_seconds(tmp_path) == [1.0, 0.5]


def test_the_prose_corpus_is_cut_at_separators_and_left_untouched_when_unchanged(tmp_path):
    """Sections end at a line of 70 `=`, pieces hold whole paragraphs of at most 4 KB; building
    again from the same files leaves the jsonl as it was, mtime included (no new prepare)."""
    import json
    import os

    from benchmarks import prose
    sep = "=" * 78 + "\n"
    (tmp_path / "a.txt").write_text("intro\n\n" + sep + "one\n\ntwo\n\n" + sep + "\n")
    (tmp_path / "b.txt").write_text("x" * 5000 + "\n\nshort\n")
    out = prose.build(tmp_path / "out", str(tmp_path / "*.txt"))
    texts = [json.loads(line)["text"] for line in out.read_text().splitlines()]
    assert texts == ["intro\n\n", "one\n\ntwo\n\n", "x" * 5000 + "\n\n", "short\n"]
    os.utime(out, ns=(1, 1))
    prose.build(tmp_path / "out", str(tmp_path / "*.txt"))
    assert out.stat().st_mtime_ns == 1
    (tmp_path / "b.txt").write_text("changed\n")
    prose.build(tmp_path / "out", str(tmp_path / "*.txt"))
    assert out.stat().st_mtime_ns != 1 and "changed" in out.read_text()
    assert sorted(os.listdir(tmp_path / "out")) == ["SOURCES.txt", "vimhelp.jsonl"]


def test_the_perl_corpus_starts_a_piece_at_each_head_and_reads_a_linked_directory_once(tmp_path):
    """POD sections start at `=head1`/`=head2` lines, which they keep; a directory reached twice
    by the glob (Debian's 5.36 -> 5.36.0 link) is read once."""
    import json

    from benchmarks import prose
    real = tmp_path / "5.36.0" / "pod"
    real.mkdir(parents=True)
    (tmp_path / "5.36").symlink_to(tmp_path / "5.36.0")
    (real / "a.pod").write_text("=head1 NAME\n\na - x\n\n=head2 More\n\ntext\n\n=item not\n")
    out = prose.build(tmp_path / "out", str(tmp_path / "5*" / "pod" / "*.pod"), source="perl")
    texts = [json.loads(line)["text"] for line in out.read_text().splitlines()]
    assert out.name == "perldoc.jsonl"
    assert texts == ["=head1 NAME\n\na - x\n\n", "=head2 More\n\ntext\n\n=item not\n"]
    assert "1 files" in (tmp_path / "out" / "SOURCES.txt").read_text().splitlines()[0]


def test_a_screen_stops_at_as_many_tokens_on_the_whole_runs_schedule():
    halved = levers.cut([*levers.BASE, *levers.flags("batch-32")], 130)  # 32 sequences a step
    assert halved[-4:] == ["--optim.decay-steps", "100", "--run.steps", "65"]
    assert levers.cut(levers.BASE, 130)[-4:] == ["--optim.decay-steps", "200", "--run.steps", "130"]
    whole = get_preset("speedrun").optim
    screen = dataclasses.replace(whole, decay_steps=200)
    assert [lr_at(s, screen, 130) for s in range(130)] == [lr_at(s, whole, 200) for s in range(130)]

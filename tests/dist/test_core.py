"""CORE at W=2 and W=3 (each rank its share of the bundle's examples, one all-reduce) gives the
figures one process gives, to the bit."""

import json

import pytest
import torch

from ddpgpt.data.tokenizer import ByteTokenizer
from ddpgpt.distributed.group import DistEnv
from ddpgpt.evals import bundle as core_bundle
from ddpgpt.evals import core
from tests.core_bundle import write_bundle
from tests.dist import workers
from tests.processes import run_ranks

pytestmark = [pytest.mark.dist, pytest.mark.timeout(180)]


@pytest.mark.parametrize("W,n", [(2, 13), (3, 12)])
def test_core_at_w_processes_equals_one_process(tmp_path, W, n):
    """3 tasks of n examples: 39 split 20/19 at W=2 (rank 1 repeats one uncounted forward), 36
    split 12 each at W=3; a task's examples on several ranks, each rank several tasks'; the
    model's block cuts most rows. The model (seed 4) answers example 1 right: the one rank 1
    repeats at W=2, so counting the repeat would show."""
    bundle = str(write_bundle(tmp_path, n=n))
    mc = core_bundle.read(bundle)[0]
    (repeated,) = core.render(mc, [1], ByteTokenizer(), 64)
    assert core.correct(workers.core_model(64, 4), repeated, 64, torch.device("cpu"))
    one = workers.core_scores(DistEnv(), bundle, block=64, seed=4)
    out = tmp_path / "core.json"
    run_ranks([["-m", "tests.dist.workers", "core_scores",
                json.dumps({"bundle": bundle, "block": 64, "seed": 4}), str(out)]] * W,
              tmp_path / "logs")
    many = json.loads(out.read_text())
    assert many["scores"] == one["scores"]
    assert 0 < one["scores"]["core_mc_acc"] < 1  # not a trivial all-or-nothing model
    assert many["all_reduces"] == one["all_reduces"] == 1

"""model.attention flex trains on a CPU (torch's forward, model/flex_cpu.py's backward): a run's
losses at W=1 and W=2 equal the same run's through SDPA's dense mask at W=1 (test_align.py
holds SDPA's with the document mask to the same losses at W=1, 2 and 4), and a flex run resumed
from its step-3 checkpoint is bitwise the uninterrupted flex run, at W=1 and at W=2.

One set of runs serves every assertion: 6 steps of rows that start at documents (data.align bos,
the document mask) of 160 tokens (two blocks of 128 a side, the second cut), through sdpa at W=1
and flex at W=1 and W=2, then each flex run resumed from step 3 (its step-6 checkpoint removed,
as after a crash) at its own W. The data: test_align's short documents (5 to 60 bytes), several to
a row, crossing row starts.
"""

import json
import shutil

import numpy as np
import pytest
import torch

from tests.dist.test_align import EOT, docs_data  # noqa: F401 -- a fixture, used by name
from tests.helpers import read_metrics, saved_state, tiny_train_args
from tests.processes import run_ranks

pytestmark = [pytest.mark.dist, pytest.mark.timeout(900)]
STEPS, K, T = 6, 3, 160


def args(data, run_dir, attention):
    return tiny_train_args(data, run_dir, STEPS, data__align="bos", model__block_size=T,
                           model__attention=attention)


@pytest.fixture(scope="module")
def runs(docs_data, tmp_path_factory):  # noqa: F811 -- the imported fixture
    root = tmp_path_factory.mktemp("flex")
    out = {}
    for attention, W in (("sdpa", 1), ("flex", 1), ("flex", 2)):
        run_dir = root / f"{attention}{W}" / "run"
        run_ranks([args(docs_data, run_dir, attention)] * W, run_dir.parent / "logs",
                  timeout=300)
        out[f"{attention}{W}"] = run_dir
    for W in (1, 2):
        run_dir = root / f"resumed{W}" / "run"
        shutil.copytree(out[f"flex{W}"], run_dir)
        shutil.rmtree(run_dir / "checkpoints" / f"step_{STEPS:07d}")
        results = run_ranks([args(docs_data, run_dir, "flex")] * W, run_dir.parent / "logs",
                            timeout=300)
        assert f"(step {K}, saved at world size {W})" in results[0].stderr
        out[f"resumed{W}"] = run_dir
    return out


def losses(run_dir):
    rows = read_metrics(run_dir)[0]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    return [r["loss"] for r in rows]


def final(run_dir):
    return saved_state(run_dir / "checkpoints" / f"step_{STEPS:07d}")


def test_the_runs_are_what_they_say(runs):
    for name, run_dir in runs.items():
        saved = json.loads((run_dir / "config.json").read_text())["model"]
        assert saved["attention"] == name.rstrip("12").replace("resumed", "flex"), name
        assert saved["doc_mask"] is True and saved["bos_id"] == EOT
        assert saved["block_size"] == T


@pytest.mark.parametrize("W", [1, 2])
def test_flex_s_losses_are_sdpa_s(runs, W):
    """Against SDPA's run at W=1 (SDPA's losses with the document mask are the same at W=1, 2
    and 4: tests/dist/test_align.py)."""
    got, want = losses(runs[f"flex{W}"]), losses(runs["sdpa1"])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=0)


@pytest.mark.parametrize("W", [1, 2])
def test_a_resumed_flex_run_is_bitwise_the_straight_one(runs, W):
    assert losses(runs[f"resumed{W}"]) == losses(runs[f"flex{W}"])
    state, ref = final(runs[f"resumed{W}"]), final(runs[f"flex{W}"])
    for name, value in ref["model"].items():
        assert torch.equal(state["model"][name], value), name
    assert state["loader"] == ref["loader"]

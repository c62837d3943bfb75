"""Training on rows that start at document starts, with the document mask (--data.align bos):
the same losses at W=1, 2 and 4, and exact resume at the same W and at another.

One set of runs serves every assertion: 6 steps at W=2 (checkpoints at 3 and 6), W=1 and W=4, then
the W=2 run resumed from step 3 (its step-6 checkpoint removed, as after a crash) at W=2 and at
W=1. The data: short documents of standard-library text (5 to 60 bytes each), so that most rows
of 33 tokens hold several documents and the mask matters.
"""

import json
import shutil

import numpy as np
import pytest
import torch

from tests.conftest import CORPUS, STDLIB
from tests.helpers import read_metrics, saved_state, tiny_train_args, write_dataset
from tests.processes import run_ranks

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]
STEPS, K = 6, 3
EOT = 256


@pytest.fixture(scope="module")
def docs_data(tmp_path_factory):
    text = np.frombuffer(b"".join((STDLIB / f).read_bytes() for f in CORPUS[:4]), np.uint8)
    rng = np.random.default_rng(0)
    cuts = np.cumsum(rng.integers(5, 61, len(text) // 5))
    cuts = cuts[cuts < len(text)]
    tokens = np.insert(text.astype(np.int64), cuts, EOT)  # end-of-text before each document
    tokens = np.insert(tokens, 0, EOT)
    split = int(len(tokens) * 0.9)
    return write_dataset(tmp_path_factory.mktemp("docs") / "d", tokens[:split], tokens[split:],
                         vocab_size=257, eot_id=EOT)


@pytest.fixture(scope="module")
def runs(docs_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("align")
    out = {}
    for name, W in (("w2", 2), ("w1", 1), ("w4", 4)):
        run_dir = root / name / "run"
        run_ranks([tiny_train_args(docs_data, run_dir, STEPS, data__align="bos")] * W,
                  run_dir.parent / "logs")
        out[name] = run_dir
    for W in (2, 1):
        run_dir = root / f"resumed{W}" / "run"
        shutil.copytree(out["w2"], run_dir)
        shutil.rmtree(run_dir / "checkpoints" / f"step_{STEPS:07d}")
        results = run_ranks([tiny_train_args(docs_data, run_dir, STEPS, data__align="bos")] * W,
                            run_dir.parent / "logs")
        assert f"(step {K}, saved at world size 2)" in results[0].stderr
        out[f"resumed{W}"] = run_dir
    return out


def losses(run_dir):
    rows = read_metrics(run_dir)[0]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    return [r["loss"] for r in rows]


def final(run_dir):
    return saved_state(run_dir / "checkpoints" / f"step_{STEPS:07d}")


def test_the_run_masks_documents(runs):
    saved = json.loads((runs["w2"] / "config.json").read_text())
    assert saved["data"]["align"] == "bos"
    assert saved["model"]["doc_mask"] is True and saved["model"]["bos_id"] == EOT


def test_losses_equal_at_w1_w2_and_w4(runs):
    for W in ("w1", "w4"):
        np.testing.assert_allclose(losses(runs[W]), losses(runs["w2"]), rtol=1e-6, atol=0,
                                   err_msg=W)


def test_resume_same_world_size_is_bitwise(runs):
    assert losses(runs["resumed2"]) == losses(runs["w2"])
    state, ref = final(runs["resumed2"]), final(runs["w2"])
    for name, value in ref["model"].items():
        assert torch.equal(state["model"][name], value), name
    assert state["loader"] == ref["loader"]


def test_resume_at_another_world_size(runs):
    got, want = losses(runs["resumed1"]), losses(runs["w2"])
    assert got[:K] == want[:K]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=0)
    state, ref = final(runs["resumed1"]), final(runs["w2"])
    for name, value in ref["model"].items():
        torch.testing.assert_close(state["model"][name], value, rtol=0, atol=5e-5, msg=name)

"""World-size invariance of training, against an oracle written here.

The same tiny config for 8 steps at (W=1, A=4), (W=2, A=2) and (W=4, A=1) with G = 8 sequences:
per-step losses and final parameters agree (W=2 is the session's straight run, which
tests/dist/test_recovery_*.py compare with), and match a plain single-process reference that
takes the whole global batch in one forward and one backward (no DDP, no accumulation).

Tolerances: the runs differ only in the order floating-point sums are taken (accumulation over
micro-steps vs. DDP's average over ranks). Measured on a 2-core x86 CPU, fp32: losses within
1.2e-7 relative and parameters within 2.2e-5 absolute of the oracle after 8 AdamW steps at lr
1e-2 (1.8e-7 and 5.3e-6 after 6). We allow 2e-5 and 5e-5.
"""

import numpy as np
import pytest
import torch

from tests.dist.recovery_runs import STEPS, train_args
from tests.helpers import read_metrics, reference_training, saved_weights
from tests.processes import run_ranks

pytestmark = [pytest.mark.dist, pytest.mark.timeout(240)]
G, T = 8, 32
LOSS_TOL, PARAM_TOL = 2e-5, 5e-5


@pytest.fixture(scope="module")
def runs(tiny_data, straight, tmp_path_factory):
    """The three (W, A) configurations, each trained through `-m ddpgpt train` on W processes;
    W=2 is the session's straight run (tests/dist/conftest.py: the same config, through
    `--nproc 2`, a checkpoint every 2 steps)."""
    out = {}
    for W in (1, 2, 4):
        run_dir = straight
        if W != 2:
            run_dir = tmp_path_factory.mktemp(f"w{W}") / "run"
            args = train_args(tiny_data, run_dir, nproc=0, run__checkpoint_every=STEPS)[1:]
            run_ranks([args] * W, run_dir.parent / "logs")
        rows, evals = read_metrics(run_dir)
        weights = saved_weights(run_dir / "checkpoints" / f"step_{STEPS:07d}")
        out[W] = ([r["loss"] for r in rows], weights, rows, evals)
    return out


@pytest.fixture(scope="module")
def reference(tiny_data):
    """The oracle's (losses, final weights)."""
    return reference_training(tiny_data, STEPS)


def test_runs_log_every_step(runs):
    for _, _, rows, _ in runs.values():
        assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
        assert [r["tokens"] for r in rows] == [G * T * s for s in range(1, STEPS + 1)]


def test_losses_agree_across_world_sizes_and_with_oracle(runs, reference):
    ref_losses, _ = reference
    for W, (losses, _, _, _) in runs.items():
        np.testing.assert_allclose(losses, ref_losses, rtol=LOSS_TOL, atol=0, err_msg=f"W={W}")
    assert ref_losses[-1] < ref_losses[0] - 0.5  # it learns: the comparison is not of noise


def test_final_parameters_agree_across_world_sizes_and_with_oracle(runs, reference):
    _, ref_params = reference
    for W, (_, weights, _, _) in runs.items():
        assert weights.keys() == ref_params.keys()
        for name, p in ref_params.items():
            torch.testing.assert_close(weights[name], p, rtol=0, atol=PARAM_TOL,
                                       msg=f"W={W} {name}")


def test_train_eval_loss_agrees_across_world_sizes_and_with_oracle(runs, tiny_data):
    """The final evaluation's train_eval_loss: the same sample of training windows at every W,
    and the loss a plain forward of the saved weights gives on those windows, sliced here from
    the train stream (the sample: the first 16 positions of data.seed's order of epoch
    SAMPLE_EPOCH, sorted)."""
    from ddpgpt.config.model import ModelConfig
    from ddpgpt.config.schema import padded_vocab
    from ddpgpt.data import order
    from ddpgpt.data.loader import SAMPLE_EPOCH
    from ddpgpt.data.shards import TokenDataset
    from ddpgpt.model.gpt import GPT

    ds = TokenDataset(tiny_data)
    stream = torch.from_numpy(np.concatenate(ds.tokens("train")).astype(np.int64))
    n = (len(stream) - 1) // T
    windows = np.sort(order.epoch_order(n, 1337, SAMPLE_EPOCH).items(0, 16))
    assert len(set(windows.tolist())) == 16 and windows.max() > 16  # a sample, not the start
    batch = torch.stack([stream[w * T:w * T + T + 1] for w in windows])  # (16, T+1)
    model = GPT(ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=32,
                            vocab_size=padded_vocab(ds.vocab_size)), seed=0)
    model.load_state_dict(runs[1][1])
    model.eval()
    with torch.no_grad():
        logits = model(batch[:, :-1])[0]
        oracle = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)),
                                                   batch[:, 1:].reshape(-1)).item()
    for W, (_, _, _, evals) in runs.items():
        assert evals[-1]["step"] == STEPS
        np.testing.assert_allclose(evals[-1]["train_eval_loss"], oracle, rtol=LOSS_TOL,
                                   err_msg=f"W={W}")
        assert evals[-1]["train_eval_loss"] != evals[-1]["val_loss"]

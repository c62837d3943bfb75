"""Fine-tuning on conversations is the same training at W = 1, 2 and 4, at b = 1, 2 and 4 and
in every sync mode: the loss is the sum over the global batch's unmasked targets divided by
their number, counted before the backward (trainer.py). The per-micro-batch mean (each
micro-batch's mean over its own assistant tokens, / A, averaged over W: nanochat's SFT loss)
is run beside it on the same data and gives other losses, another at each b, so these tests
can fail. A plain-text source mixed in (its mask all ones) keeps the same invariance. One shared
launch per W (module fixture); tests/unit/test_chat_training.py holds the one-process oracles.

Tolerance: fp32 on a CPU, the runs differing only in the order float sums are taken (the
modes' and W's reductions, the micro-steps' accumulation); measured on the 2-core VM within
1.1e-7 relative over 6 steps. We allow 1e-5, as test_muon.py does.
"""

import json

import numpy as np
import pytest

from ddpgpt.config.commands import PrepareConfig
from ddpgpt.config.model import ModelConfig
from ddpgpt.data.prepare import main as prepare
from ddpgpt.sync.modes import MODES
from tests.conftest import CORPUS, STDLIB
from tests.helpers import write_run
from tests.processes import run_ranks

pytestmark = [pytest.mark.dist, pytest.mark.timeout(400)]
STEPS = 6
TOL = 1e-5


def variants(world: int, mix: str, base: str) -> list[dict]:
    """Every mode at b = 2; ddp at the other micro-batches that divide G = 8 at this W (b = 1,
    4); the per-micro-batch mean at b = 2 and 4 (at b = 1 a micro-batch of one row without an
    assistant token has no mean: NaN, the whole run with it); the mixture at b = 2; a fine-tune
    from a base run (--init-from, its vocabulary grown) at b = 1 and 4."""
    fits = [b for b in (1, 2, 4) if 8 % (world * b) == 0]
    out = [{"name": f"{mode} b=2", "mode": mode, "b": 2} for mode in MODES]
    out += [{"name": f"ddp b={b}", "mode": "ddp", "b": b} for b in fits if b != 2]
    out += [{"name": f"per-micro b={b}", "mode": "ddp", "b": b, "per_micro": True}
            for b in fits if b != 1]
    out += [{"name": "mix b=2", "mode": "ddp", "b": 2, "data": mix}]
    out += [{"name": f"init b={b}", "mode": "ddp", "b": b, "init": base} for b in fits
            if b != 2]
    return out


@pytest.fixture(scope="module")
def runs(chat_data, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sft")
    plain = tmp / "plain"  # a plain-text source with the conversations' tokenizer
    prepare.run(PrepareConfig(sources=[str(STDLIB / f) for f in CORPUS[:3]], out=str(plain),
                              tokenizer_from=str(chat_data), val_fraction=0.2, workers=1))
    mix = f"{chat_data}:0.7,{plain}:0.3"
    base = tmp / "base"  # a byte-level base run of the same shape, not fine-tuned
    write_run(base, ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=32, vocab_size=257,
                                arch="modern"), "byte", 257)
    result = {}
    for world in (1, 2, 4):
        out = tmp / f"out_{world}.json"
        args = {"data": str(chat_data), "run_dir": str(tmp / "run"), "steps": STEPS,
                "variants": variants(world, mix, str(base)), "group_at_one": world == 1}
        run_ranks([["-m", "tests.dist.workers_chat", "sft", json.dumps(args), str(out)]] * world,
                  tmp / f"logs_{world}", timeout=300)
        result[world] = json.loads(out.read_text())
    return result


def test_the_fine_tune_is_the_same_at_every_world_size_micro_batch_and_mode(runs):
    reference = runs[1]["ddp b=2"]["losses"]
    assert runs[1]["ddp b=2"]["masked"] and runs[1]["ddp b=2"]["align"] == "bos"
    assert reference[-1] < reference[0] - 0.5  # it learns
    worst = 0.0
    for world, named in runs.items():
        for name, run in named.items():
            if name.startswith(("per-micro", "mix", "init")):
                continue
            np.testing.assert_allclose(run["losses"], reference, rtol=TOL, atol=0,
                                       err_msg=f"{name} W={world}")
            worst = max(worst, *(abs(a / b - 1) for a, b in zip(run["losses"], reference)))
    print(f"\n[figure] SFT, every mode and b at W=1, 2, 4 vs ddp b=2 at W=1: within {worst:.1e}")


def test_the_per_micro_batch_mean_is_another_loss_at_each_w_and_b(runs):
    ours = runs[1]["ddp b=2"]["losses"]
    theirs = {(w, b): runs[w][f"per-micro b={b}"]["losses"] for w in runs for b in (2, 4)
              if f"per-micro b={b}" in runs[w]}
    for key, losses in theirs.items():
        gap = max(abs(a / b - 1) for a, b in zip(losses, ours))
        assert gap > 100 * TOL, (key, gap)
    # It weighs a conversation by the micro-batch it lands in: other b, other losses. (Not
    # other W at the same b here: the loader gives the same rows to each micro-batch at any W;
    # a loader whose ranks read their own rows, nanochat's, changes them with W as well.)
    for world in (1, 2):
        assert max(abs(a / b - 1) for a, b in zip(theirs[world, 2], theirs[world, 4])) > \
            100 * TOL
    print("\n[figure] the losses of steps 1-6: ours " + ", ".join(f"{x:.5f}" for x in ours) +
          " at every W, b and mode; the per-micro-batch mean: " + "; ".join(
              f"W={w} b={b}: " + ", ".join(f"{x:.5f}" for x in losses)
              for (w, b), losses in theirs.items()))


def test_a_plain_source_mixed_in_keeps_the_invariance(runs):
    reference = runs[1]["mix b=2"]["losses"]
    assert runs[1]["mix b=2"]["masked"]
    assert reference != runs[1]["ddp b=2"]["losses"]  # other rows
    for world in (2, 4):
        np.testing.assert_allclose(runs[world]["mix b=2"]["losses"], reference, rtol=TOL,
                                   atol=0, err_msg=f"W={world}")


def test_a_fine_tune_from_a_base_run_is_the_same_at_w_1_2_4_and_b_1_4(runs):
    """--init-from the base run (its 257 ids grown to the template's 263), at W = 1 and 2 with
    b = 1 and 4, and at W = 4 with b = 1: the same losses, and not those from scratch."""
    reference = runs[1]["init b=1"]["losses"]
    assert reference != runs[1]["ddp b=2"]["losses"]
    for world, named in runs.items():
        for name in ("init b=1", "init b=4"):
            if name in named:
                np.testing.assert_allclose(named[name]["losses"], reference, rtol=TOL, atol=0,
                                           err_msg=f"{name} W={world}")
    assert {"init b=4"} <= set(runs[2]) and {"init b=1"} <= set(runs[4])

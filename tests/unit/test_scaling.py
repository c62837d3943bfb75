"""docs/sync.md's scaling figures (benchmarks/scaling.py) follow from the stated formulas."""

import pytest

from benchmarks import scaling
from ddpgpt.bench import sent_bytes


def test_ring_bytes_per_mode():
    N, W = 1000, 8
    ddp = sent_bytes("ddp", N, W, accum=4, compress=False)
    assert ddp == int(2 * 7 / 8 * 4 * N)
    assert sent_bytes("zero1", N, W, 4, False) == ddp  # reduce-scatter + all-gather
    assert sent_bytes("ddp", N, W, 4, True) == ddp // 2  # bf16 on the wire
    assert sent_bytes("fsdp2", N, W, 4, False) == pytest.approx(ddp * (2 * 4 + 1) / 2, abs=1)


def test_exposure_is_what_the_last_backward_cannot_hide():
    N, W, step = 10**9, 2, 1.0  # one pass over fp32 gradients: 0.5 * 4e9 / bandwidth
    bandwidth = 2e9 / (1 / 3)   # an all-reduce (two passes) then takes 2/3 s
    assert scaling.exposed("ddp", N, W, 1, bandwidth, step) == pytest.approx(0.0, abs=1e-12)
    # at A=2 the last backward is 1/3 s: 1/3 s stays exposed
    assert scaling.exposed("ddp", N, W, 2, bandwidth, step) == pytest.approx(1 / 3)
    assert scaling.share(1 / 3, step) == pytest.approx(0.25)
    # zero1 adds the parameter all-gather after the step, which nothing hides
    assert scaling.exposed("zero1", N, W, 1, bandwidth, step) == pytest.approx(1 / 3)


def test_largest_model_per_mode():
    assert scaling.largest_model("ddp", 8) == pytest.approx(70e9 / 16)
    assert scaling.largest_model("zero1", 8) == pytest.approx(70e9 / (8 + 12 / 8))
    assert scaling.largest_model("fsdp2", 8) == pytest.approx(70e9 / (2 + 16 / 24))

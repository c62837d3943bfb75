"""The mode table's byte and exposure formulas (ddpgpt.sync.MODES), which `ddpgpt bench` and
docs/sync.md's scaling figures (benchmarks/scaling.py) read."""

import pytest

from benchmarks import scaling
from ddpgpt.sync.modes import MODES, Traffic


def test_ring_bytes_per_mode():
    N, W = 1000, 8
    ddp = MODES["ddp"].sent(Traffic(N, W, accum=4))
    assert ddp == 2 * 7 / 8 * 4 * N
    assert MODES["zero1"].sent(Traffic(N, W, 4)) == ddp  # reduce-scatter + all-gather
    assert MODES["ddp"].sent(Traffic(N, W, 4, grad_bytes=2)) == ddp / 2  # bf16 on the wire
    assert MODES["fsdp2"].sent(Traffic(N, W, 4)) == pytest.approx(ddp * (2 * 4 + 1) / 2)


def test_muon_bytes_per_mode():
    """M of the N parameters are Muon's matrices, laid out by owner in P >= M elements."""
    N, M, P, W = 1000, 600, 640, 8
    muon, plain = Traffic(N, W, 1, matrices=M, padded=P), Traffic(N, W, 1)
    ring = 7 / 8
    for mode in ("ddp", "allreduce", "rs-ag"):  # then the owners' new matrices all-gathered
        assert MODES[mode].sent(muon) == pytest.approx(MODES[mode].sent(plain) + ring * 4 * P)
    # whole matrices inside zero1's reduce-scatter and all-gather: only the padding is extra
    assert MODES["zero1"].sent(muon) == pytest.approx(ring * 8 * (N - M + P))
    # two all-to-alls: each rank sends its 1/W rows of the others' matrices, 12 bytes each
    assert MODES["fsdp2"].sent(muon) == pytest.approx(MODES["fsdp2"].sent(plain)
                                                      + ring * 12 * M / W)


def test_exposure_is_what_the_last_backward_cannot_hide():
    N, W, step = 10**9, 2, 1.0  # one pass over fp32 gradients: 0.5 * 4e9 / bandwidth
    bandwidth = 2e9 / (1 / 3)   # an all-reduce (two passes) then takes 2/3 s
    one, two = Traffic(N, W, 1), Traffic(N, W, 2)
    assert scaling.exposed("ddp", one, bandwidth, step) == pytest.approx(0.0, abs=1e-12)
    # at A=2 the last backward is 1/3 s: 1/3 s stays exposed
    assert scaling.exposed("ddp", two, bandwidth, step) == pytest.approx(1 / 3)
    assert scaling.share(1 / 3, step) == pytest.approx(0.25)
    # zero1 adds the parameter all-gather after the step, which nothing hides
    assert scaling.exposed("zero1", one, bandwidth, step) == pytest.approx(1 / 3)
    # under Muon ddp all-gathers the owners' matrices after the step: exposed as well
    muon = Traffic(N, W, 1, matrices=N // 2, padded=N // 2)
    assert scaling.exposed("ddp", muon, bandwidth, step) == pytest.approx(1 / 6)


def test_largest_model_per_mode():
    assert scaling.largest_model("ddp", 8) == pytest.approx(70e9 / 16)
    assert scaling.largest_model("zero1", 8) == pytest.approx(70e9 / (8 + 12 / 8))
    assert scaling.largest_model("fsdp2", 8) == pytest.approx(70e9 / (2 + 16 / 24))

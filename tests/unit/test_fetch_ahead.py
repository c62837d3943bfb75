"""How far ahead the loader names its windows to a remote reader (fetch.ahead_steps), and a
dataset read through a cloud's latency (tests/shaper.py) giving the local batches."""

from __future__ import annotations

import time

import numpy as np
import pytest

from ddpgpt.data.fetch import AHEAD_BYTES, MAX_AHEAD, MIN_AHEAD, ahead_steps
from ddpgpt.data.loader import RAMP, TrainLoader
from ddpgpt.data.shards import TokenDataset

MB = 1 << 20


@pytest.mark.parametrize("arrival, step, expected", [
    (0.0, 0.1, MIN_AHEAD),  # nothing fetched yet
    (0.5, 0.0, MIN_AHEAD),  # no step timed yet
    (0.05, 0.1, MIN_AHEAD),  # arrives within a step: the floor's slack
    (0.3, 0.1, MIN_AHEAD),
    (0.301, 0.1, 5),  # ceil(3.01) + 1
    (1.0, 0.1, 11),
    (1.0, 0.5, MIN_AHEAD),
    (3.0, 0.1, MAX_AHEAD),  # ceil(30) + 1, bounded
])
def test_the_distance_is_the_arrival_in_steps_plus_one_within_bounds(arrival, step, expected):
    assert ahead_steps(arrival, step, step_bytes=MB) == expected


def test_the_distance_holds_no_more_than_the_memory_cap():
    assert ahead_steps(1.0, 0.1, step_bytes=AHEAD_BYTES // 5) == 5
    assert ahead_steps(0.0, 0.0, step_bytes=AHEAD_BYTES // 3) == 3  # the floor too is capped
    assert ahead_steps(1.0, 0.1, step_bytes=AHEAD_BYTES) == 2  # but never under the next step


def test_a_loader_through_100_ms_reads_the_local_batches_and_names_its_distance(
        cloud, s3_dataset, tiny_data):
    """At 0.1 s per request every batch is the local copy's, byte for byte (the fetch ahead
    changes only when bytes arrive), each step has named to the reader the windows of the
    steps its distance (`ahead`: fetch.ahead_steps) asks for (RAMP more a step once started),
    and the reader timed the fetches
    at the shaper's 0.1 s at least."""
    cloud(0.1, 50e6)
    kw = dict(seq_len=32, micro_batch=2, world_size=2, rank=1, accum_steps=2, seed=3)
    remote = TrainLoader(TokenDataset(s3_dataset), **kw)
    local = TrainLoader(TokenDataset(tiny_data), **kw)
    named = 0
    for _ in range(8):
        for (x1, y1), (x2, y2) in zip(remote.next_step(), local.next_step()):
            assert np.array_equal(x1, x2) and np.array_equal(y1, y2)
        assert remote.ahead >= MIN_AHEAD
        current = remote.batch_index - 1  # a start names the whole distance, then RAMP a step
        wanted = current + remote.ahead if not named else min(current + remote.ahead,
                                                              named + RAMP)
        assert remote.fetched_until >= wanted
        named = remote.fetched_until
        time.sleep(0.02)
    assert remote.stream.arrival_s >= 0.1

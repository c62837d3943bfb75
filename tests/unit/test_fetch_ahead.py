"""How far ahead the loader names its windows to a remote reader (fetch.ahead_steps), and a
dataset read through a cloud's latency (tests/shaper.py) giving the local batches."""

from __future__ import annotations

import time

import numpy as np
import pytest

from ddpgpt.data.fetch import AHEAD_BYTES, MAX_AHEAD, MIN_AHEAD, START_AHEAD, ahead_steps
from ddpgpt.data.loader import TrainLoader
from ddpgpt.data.shards import TokenDataset

MB = 1 << 20


@pytest.mark.parametrize("arrival, step, expected", [
    (0.0, 0.1, START_AHEAD),  # nothing fetched yet: a guess
    (0.5, 0.0, START_AHEAD),  # no step timed yet
    (0.05, 0.1, 2),  # arrives within a step: this one and the next
    (0.1, 0.1, 2),
    (0.101, 0.1, 3),
    (0.25, 0.1, 4),
    (0.25, 0.5, 2),
    (3.0, 0.1, MAX_AHEAD),  # ceil(30) + 1, bounded
])
def test_the_distance_is_the_arrival_in_steps_plus_one_within_bounds(arrival, step, expected):
    assert ahead_steps(arrival, step, step_bytes=MB) == expected


def test_the_distance_holds_no_more_than_the_memory_cap():
    assert ahead_steps(1.0, 0.1, step_bytes=AHEAD_BYTES // 5) == 5
    assert ahead_steps(1.0, 0.1, step_bytes=AHEAD_BYTES // 5, cap_bytes=AHEAD_BYTES) == 5
    assert ahead_steps(1.0, 0.1, step_bytes=AHEAD_BYTES) == MIN_AHEAD  # the floor wins
    assert ahead_steps(0.0, 0.0, step_bytes=AHEAD_BYTES // 3) == 3  # the guess too is capped


def test_a_loader_through_100_ms_reads_the_local_batches_and_reaches_ahead(
        cloud, s3_dataset, tiny_data):
    """At 0.1 s per request, with steps of 20 ms and more, the loader names more than the next
    step to the reader once it has timed a fetch (however long it waited for one: the step's
    time is taken without its reads), and every batch is the local copy's, byte for byte."""
    cloud(0.1, 50e6)
    kw = dict(seq_len=32, micro_batch=2, world_size=2, rank=1, accum_steps=2, seed=3)
    remote = TrainLoader(TokenDataset(s3_dataset), **kw)
    local = TrainLoader(TokenDataset(tiny_data), **kw)
    reached = []
    for _ in range(8):
        for (x1, y1), (x2, y2) in zip(remote.next_step(), local.next_step()):
            assert np.array_equal(x1, x2) and np.array_equal(y1, y2)
        reached.append(remote.fetched_until - remote.batch_index)
        time.sleep(0.02)
    assert remote.stream.arrival_s >= 0.1
    assert max(reached) > 1  # more than the next step

"""The distributed loader against a naive reference slicer, one process playing every rank.

The dataset's tokens are 0, 1, 2, ... (uint32), so a window is identified by its first token.
"""

from collections import Counter

import numpy as np
import pytest
import torch

from ddpgpt.data.loader import EvalLoader, TrainLoader
from ddpgpt.data.shards import TokenDataset
from ddpgpt.errors import DataError
from tests.helpers import reference_step, write_dataset

T = 16
SEED = 7


@pytest.fixture(scope="module")
def ds(tmp_path_factory):
    # 3 train shards of uneven size so windows cross shard boundaries; N = 3000 tokens -> 187
    # windows.
    path = tmp_path_factory.mktemp("data") / "d"
    train = np.arange(3000)
    val = np.arange(1_000_000, 1_000_000 + 533)
    write_dataset(path, train, val, vocab_size=2_000_000, shard_tokens=1111)
    return TokenDataset(path)


def make(ds, W, A, b, r=0, **kw):
    return TrainLoader(ds, seq_len=T, micro_batch=b, world_size=W, rank=r, accum_steps=A,
                       seed=SEED, **kw)


def step_rows(loaders) -> list[list[np.ndarray]]:
    """One step from each rank's loader: rows[rank] = that rank's windows, micro-step by
    micro-step."""
    out = []
    for loader in loaders:
        rows = []
        for x, y in loader.next_step():
            assert (x.shape == y.shape == (loader.micro_batch, T)
                    and x.dtype == y.dtype == torch.int64)
            torch.testing.assert_close(x[:, 1:], y[:, :-1], rtol=0, atol=0)
            rows += [np.concatenate([xr.numpy(), yr[-1:].numpy()]) for xr, yr in zip(x, y)]
        out.append(rows)
    return out


def test_matches_reference_slicer(ds):
    stream = np.concatenate(ds.tokens("train"))
    W, A, b = 2, 2, 3
    loaders = [make(ds, W, A, b, r) for r in range(W)]
    G = W * A * b
    for k in range(3 * loaders[0].steps_per_epoch + 2):  # crosses epoch boundaries
        rows = step_rows(loaders)
        ref = list(reference_step(stream, SEED, T, G, k))
        for r in range(W):
            for m in range(A):
                mine = rows[r][m * b:(m + 1) * b]
                expected = ref[(m * W + r) * b:(m * W + r + 1) * b]
                for got, want in zip(mine, expected):
                    np.testing.assert_array_equal(got, want)


def test_no_overlap_and_every_window_once_per_epoch(ds):
    W, A, b = 4, 1, 5
    loaders = [make(ds, W, A, b, r) for r in range(W)]
    n, spe = loaders[0].stream.num_windows, loaders[0].steps_per_epoch
    assert spe == n // (W * A * b) == 9
    for epoch in range(2):
        seen = []
        for _ in range(spe):
            rows = step_rows(loaders)
            step_ids = [int(row[0]) // T for rank_rows in rows for row in rank_rows]
            assert len(set(step_ids)) == len(step_ids)  # ranks never share a window
            seen += step_ids
        assert len(seen) == len(set(seen)) == spe * W * A * b  # once each; n mod G dropped
        assert set(seen) <= set(range(n))
        assert loaders[0].epoch == epoch


@pytest.mark.parametrize("shuffle", [True, False])
def test_world_size_invariance(ds, shuffle):
    """(W, A) in {(1,4), (2,2), (4,1)}, b=2, G=8: each step's multiset of windows is identical."""
    per_config = []
    for W, A in ((1, 4), (2, 2), (4, 1)):
        loaders = [make(ds, W, A, 2, r, shuffle=shuffle) for r in range(W)]
        steps = []
        for _ in range(30):
            rows = step_rows(loaders)
            steps.append(Counter(int(row[0]) for rank_rows in rows for row in rank_rows))
        per_config.append(steps)
    assert per_config[0] == per_config[1] == per_config[2]
    if not shuffle:
        assert sorted(per_config[0][0]) == [w * T for w in range(8)]


def test_resume_same_and_other_world_size(ds):
    """n steps straight == k steps + state round trip + n-k steps, also at another (W, A)."""
    n, k, G = 40, 17, 12  # crosses the epoch boundary (15 steps per epoch)

    def flat(rows_per_step):
        return [sorted(int(row[0]) for rank_rows in rows for row in rank_rows)
                for rows in rows_per_step]

    straight = [make(ds, 2, 3, 2, r) for r in range(2)]
    reference = flat([step_rows(straight) for _ in range(n)])
    for W2, A2, b2 in ((2, 3, 2), (3, 1, 4), (1, 6, 2)):
        first = [make(ds, 2, 3, 2, r) for r in range(2)]
        head = flat([step_rows(first) for _ in range(k)])
        state = first[0].state_dict()
        assert state == first[1].state_dict()  # one global cursor, the same on every rank
        second = [make(ds, W2, A2, b2, r) for r in range(W2)]
        assert second[0].global_batch == G
        for loader in second:
            loader.load_state_dict(state)
        tail = flat([step_rows(second) for _ in range(n - k)])
        assert head + tail == reference


def test_load_state_rejects_other_seed(ds):
    state = make(ds, 1, 1, 4).state_dict()
    other = TrainLoader(ds, seq_len=T, micro_batch=4, seed=SEED + 1)
    with pytest.raises(DataError) as e:
        other.load_state_dict(state)
    assert str(e.value) == ("the checkpoint's data order was read with data.seed = 7, this run "
                            "has 8: resume with --data.seed 7 (the order cannot change mid-run), "
                            "or start a new --run-dir")


def test_load_state_names_the_flag_of_another_seq_len(ds):
    """`train --run-dir R` on a run trained at another T: the flag that resumes it."""
    state = make(ds, 1, 1, 4).state_dict()
    other = TrainLoader(ds, seq_len=T // 2, micro_batch=4, seed=SEED)
    with pytest.raises(DataError) as e:
        other.load_state_dict(state)
    assert str(e.value) == (f"the checkpoint's data order was read with data.seq_len = {T}, this "
                            f"run has {T // 2}: resume with --data.seq-len {T} (the order cannot "
                            "change mid-run), or start a new --run-dir")


def test_dataset_smaller_than_global_batch(ds):
    with pytest.raises(DataError) as e:
        make(ds, 4, 10, 5)
    assert str(e.value) == (
        f"dataset {ds.path}: the train split has 187 windows of 17 tokens, fewer than one global "
        "batch of 200; use a larger dataset, or a smaller data.seq_len / data.global_batch"
    )


def _val_windows(loader):
    """The (window start token, weight) pairs a rank evaluates; padding rows carry no targets."""
    out = []
    for x, y in loader:
        for xr, yr in zip(x, y):
            if (yr >= 0).all():
                out.append(int(xr[0]))
            else:
                assert (yr == -1).all()
    return out


@pytest.mark.parametrize("max_windows", [0, 7])
@pytest.mark.parametrize("W", [1, 2, 3, 4])
def test_val_split_union_equals_single_process(ds, W, max_windows):
    single = _val_windows(EvalLoader(ds, seq_len=T, micro_batch=4, max_windows=max_windows))
    loaders = [EvalLoader(ds, seq_len=T, micro_batch=4, world_size=W, rank=r,
                          max_windows=max_windows)
               for r in range(W)]
    assert len({lo.num_batches for lo in loaders}) == 1  # no rank is left with fewer batches
    parts = [_val_windows(lo) for lo in loaders]
    assert sorted(sum(parts, [])) == sorted(single)
    assert len(sum(parts, [])) == len(single)
    n = (533 - 1) // T
    expected = (range(n) if not max_windows
                else np.linspace(0, n - 1, max_windows).round().astype(int))
    assert sorted(single) == [1_000_000 + w * T for w in expected]

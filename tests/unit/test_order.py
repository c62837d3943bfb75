"""The epoch order (data/order.py) against a scalar oracle written from its description, and the
guarantees the loader builds on: a bijection, a pure function of (n, seed, epoch), memory and
time that do not depend on n, a shuffle worth the name, and the previous version's permutation
kept for old checkpoints (the loader state without an order version resumes on it)."""

import tracemalloc

import numpy as np
import pytest

from ddpgpt.data import order as orders
from ddpgpt.data.loader import TrainLoader
from ddpgpt.data.order import epoch_order
from ddpgpt.data.shards import TokenDataset
from ddpgpt.errors import DataError
from tests.helpers import reference_step, write_dataset

MASK64 = (1 << 64) - 1


def scalar_item(n: int, seed: int, epoch: int, position: int) -> int:
    """One position, in Python integers, as the module docstring describes it: 8 rounds of a
    Feistel network on k = bits(n - 1) bits (low half: k // 2 bits), each XORing one half with
    splitmix64's finalizer of the other half XOR the round's key, walked until below n."""
    k = max(2, (n - 1).bit_length())
    low_bits = k // 2
    low_mask, high_mask = (1 << low_bits) - 1, (1 << (k - low_bits)) - 1
    keys = [int(x) for x in np.random.SeedSequence([seed, epoch]).generate_state(8, np.uint64)]

    def mix(x):
        x ^= x >> 30
        x = (x * 0xBF58476D1CE4E5B9) & MASK64
        x ^= x >> 27
        x = (x * 0x94D049BB133111EB) & MASK64
        return x ^ (x >> 31)

    x = position
    while True:
        high, low = x >> low_bits, x & low_mask
        for i, key in enumerate(keys):
            if i % 2 == 0:
                low ^= mix(high ^ key) & low_mask
            else:
                high ^= mix(low ^ key) & high_mask
        x = (high << low_bits) | low
        if x < n:
            return x


@pytest.mark.parametrize("n, seed, epoch", [(2, 0, 0), (3, 1, 2), (187, 7, 0), (1000, 7, 1),
                                            (4096, 1337, 3), (4097, 1337, 3)])
def test_every_position_is_the_oracles_and_every_item_comes_once(n, seed, epoch):
    items = epoch_order(n, seed, epoch).items(0, n)
    assert items.tolist() == [scalar_item(n, seed, epoch, p) for p in range(n)]
    assert sorted(items.tolist()) == list(range(n))


def test_the_order_is_a_pure_function_of_n_seed_and_epoch():
    n = 10_000
    a = epoch_order(n, 7, 0).items(0, n)
    assert np.array_equal(a, epoch_order(n, 7, 0).items(0, n))
    parts = [epoch_order(n, 7, 0).items(s, s + 999) for s in range(0, n, 999)]  # any slicing
    assert np.array_equal(np.concatenate(parts), a)
    assert not np.array_equal(a, epoch_order(n, 7, 1).items(0, n))  # another epoch
    assert not np.array_equal(a, epoch_order(n, 8, 0).items(0, n))  # another seed
    assert np.array_equal(epoch_order(n, 7, 0, shuffle=False).items(5, 9), [5, 6, 7, 8])
    big = epoch_order(3 * orders.BLOCK + 5, 7, 0)  # items() cut from blocks; across their ends
    for start, stop in ((orders.BLOCK - 3, orders.BLOCK + 4), (0, 3 * orders.BLOCK + 5),
                        (3 * orders.BLOCK, 3 * orders.BLOCK + 9), (5, 5)):
        assert np.array_equal(big.items(start, stop),
                              big(np.arange(start, min(stop, big.n)))), (start, stop)


def test_a_shuffle_worth_the_name():
    """Neighbours in the order are far apart, and where an item lands does not depend on where
    it was: the 10 × 10 table of (tenth of the positions, tenth of the items) passes a
    chi-square test of independence (81 degrees of freedom; 150 is p < 1e-5), as numpy's
    permutation does."""
    n = 100_000
    for seed in (0, 1, 1337):
        items = epoch_order(n, seed, 0).items(0, n)
        assert abs(np.corrcoef(np.arange(n), items)[0, 1]) < 0.01
        assert np.mean(np.abs(np.diff(items))) == pytest.approx(n / 3, rel=0.02)  # uniform: n/3
        counts = np.histogram2d(np.arange(n), items, bins=10)[0]
        assert ((counts - n / 100) ** 2 / (n / 100)).sum() < 150


def test_memory_does_not_depend_on_n():
    """A 2e10-token dataset's windows at T=256 and 2^62 items: a global batch's positions cost
    one block of positions (65,536: ~4 MB of temporaries, 1 MB kept), as at 100,000 items, where
    the permutation of the previous version took 0.8 MB and grows with n."""
    tracemalloc.start()
    peaks = []
    for n in (100_000, 20_000_000_000 // 256, 2**62):
        tracemalloc.reset_peak()
        items = epoch_order(n, 1337, 5).items(n // 4, n // 4 + 512)
        assert len(set(items.tolist())) == 512 and items.max() < n
        peaks.append(tracemalloc.get_traced_memory()[1])
    tracemalloc.stop()
    assert max(peaks) < 6e6 and max(peaks) - min(peaks) < 0.5e6, peaks


def test_version_1_is_the_permutation_of_earlier_checkpoints():
    n = 500
    old = epoch_order(n, 7, 2, version=1)
    assert np.array_equal(old.items(0, n), np.random.default_rng([7, 2]).permutation(n))
    assert np.array_equal(old(np.array([3, 1])), old.items(0, n)[[3, 1]])
    with pytest.raises(ValueError):
        epoch_order(n, 7, 2, version=3)


@pytest.fixture(scope="module")
def ds(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "d"
    write_dataset(path, np.arange(3000), np.arange(5000, 5600), vocab_size=10_000,
                  shard_tokens=1111)
    return TokenDataset(path)


def windows(loader, steps):
    return [np.concatenate([x[:, 0].numpy() for x, _ in loader.next_step()])
            for _ in range(steps)]


def test_a_loader_state_without_an_order_version_resumes_on_the_old_permutation(ds):
    """A checkpoint written before the order had versions: its cursor on its own permutation,
    for the rest of that run (the next epoch too); a new run, and its state, use version 2."""
    T, G = 16, 8
    stream = np.concatenate(ds.tokens("train"))
    loader = TrainLoader(ds, seq_len=T, micro_batch=G, seed=7)
    assert loader.state_dict()["order"] == orders.VERSION == 2
    state = {k: v for k, v in loader.state_dict().items() if k != "order"}
    state.update(version=1, epoch=0, consumed=5 * G)  # as the previous code saved it
    old = TrainLoader(ds, seq_len=T, micro_batch=G, seed=7)
    old.load_state_dict(state)
    steps = old.steps_per_epoch
    got = windows(old, steps)  # the rest of epoch 0, then into epoch 1
    for k, row in zip(range(5, 5 + steps), got):
        assert row.tolist() == reference_step(stream, 7, T, G, k, version=1)[:, 0].tolist()
    assert old.state_dict()["order"] == 1
    fresh = TrainLoader(ds, seq_len=T, micro_batch=G, seed=7)
    assert windows(fresh, 1)[0].tolist() == reference_step(stream, 7, T, G, 0)[:, 0].tolist()
    state["order"] = 3
    with pytest.raises(DataError, match="data order is version 3, newer than this ddpgpt"):
        fresh.load_state_dict(state)

"""Mixtures (data/mixture.py) against a naive oracle written here: the rows of every step, at any
W, after a resume at another W, with the weights changed on resume; the realized proportions
over any 100 steps; the datasets' names and tokenizers."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import torch

from ddpgpt.config.schema import DataConfig
from ddpgpt.data import order
from ddpgpt.data.mixture import MixedDataset, MixtureLoader, open_data, shares, unique_names
from ddpgpt.data.shards import TokenDataset
from ddpgpt.errors import DataError
from tests.helpers import write_dataset

T, G = 8, 16


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Three byte-level datasets of different sizes (a: 40 windows, b: 13, c: 101) whose
    tokens say which dataset they come from (a: 1-50, b: 51-100, c: 101-150)."""
    root = tmp_path_factory.mktemp("mix")
    rng = np.random.default_rng(0)
    out = {}
    for k, (name, windows) in enumerate((("a", 40), ("b", 13), ("c", 101))):
        train = rng.integers(1 + 50 * k, 51 + 50 * k, windows * T + 1)
        out[name] = write_dataset(root / name, train, train[:T * 3 + 1], 256)
    return out


def mixed(sources, spec: str) -> MixedDataset:
    return open_data(DataConfig(dir=",".join(f"{sources[n]}:{w}" if w else str(sources[n])
                                             for n, w in (p.split("=") for p in
                                                          spec.split(",")))).sources())


def loader(data, W=1, rank=0, b=2, seed=5):
    return MixtureLoader(data, seq_len=T, micro_batch=b, world_size=W, rank=rank,
                         accum_steps=G // (W * b), seed=seed)


def oracle_rows(data: MixedDataset, steps: int, weights: list[float], seed: int = 5) -> list:
    """Every step's (G, T+1) tokens, by rule, row by row: the sources from the hierarchical
    split of the first n rows (exact fractions of the integer shares), each source's windows
    its epochs' orders laid end to end, sliced from its whole train stream."""
    parts = [Fraction(p, 10**6) for p in shares(weights)]
    streams = [np.concatenate(ds.tokens("train")).astype(np.int64) for ds in data.datasets]
    n_windows = [(len(s) - 1) // T for s in streams]
    sequences = [np.concatenate([order.epoch_order(n, seed, e).items(0, n)
                                 for e in range(steps * G // n + 2)]) for n in n_windows]

    def taken(n: int) -> list[int]:
        out, rest, left = [], n, Fraction(1)
        for i, p in enumerate(parts):
            c = rest if i == len(parts) - 1 else int(rest * (p / left))
            out.append(c)
            rest, left = rest - c, left - p
        return out

    steps_out = []
    for k in range(steps):
        rows = []
        for n in range(k * G, (k + 1) * G):
            before, after = taken(n), taken(n + 1)
            i = next(i for i in range(len(parts)) if after[i] > before[i])
            w = sequences[i][before[i]]
            rows.append(streams[i][w * T:w * T + T + 1])
        steps_out.append(np.stack(rows))
    return steps_out


def step_rows(loaders: list[MixtureLoader]) -> np.ndarray:
    """One step's global rows from W loaders (rank r, micro-step m: rows (m·W + r)·b ...)."""
    W, b = len(loaders), loaders[0].micro_batch
    per_rank = [[torch.cat([x, y[:, -1:]], 1).numpy() for x, y in ld.next_step()]
                for ld in loaders]
    rows = np.empty((G, T + 1), dtype=np.int64)
    for r in range(W):
        for m, batch in enumerate(per_rank[r]):
            rows[(m * W + r) * b:(m * W + r + 1) * b] = batch
    return rows


def test_rows_match_the_oracle_at_every_world_size(sources):
    data = mixed(sources, "a=0.5,b=0.2,c=0.3")
    expected = oracle_rows(data, 12, [0.5, 0.2, 0.3])  # b (13 windows) goes round ~3 times
    for W in (1, 2, 4):
        loaders = [loader(data, W, r) for r in range(W)]
        for k in range(12):
            np.testing.assert_array_equal(step_rows(loaders), expected[k], err_msg=f"W={W} k={k}")


@pytest.mark.parametrize("weights", [[0.7, 0.3], [0.5, 0.2, 0.3], [0.01, 0.98, 0.01]])
def test_realized_proportions_within_one_percent_over_any_100_steps(sources, weights):
    names = "abc"[:len(weights)]
    data = mixed(sources, ",".join(f"{n}={w}" for n, w in zip(names, weights)))
    ld = loader(data)
    source = np.concatenate([ld.rows(k)[0] for k in range(400)])  # (400·G,)
    per_step = np.stack([np.bincount(source[k * G:(k + 1) * G], minlength=len(weights))
                         for k in range(400)])  # (400, sources)
    window = np.cumsum(np.vstack([np.zeros(len(weights)), per_step]), 0)
    spans = (window[100:] - window[:-100]) / (100 * G)  # every 100-step span
    assert np.abs(spans - weights).max() <= 0.01
    assert ld.taken(400) == np.bincount(source, minlength=len(weights)).tolist()


def test_tokens_come_from_their_source(sources):
    data = mixed(sources, "a=0.5,c=0.5")
    ld = loader(data)
    for k in range(5):
        source, _ = ld.rows(k)
        rows = step_rows([ld])
        assert ((rows[source == 0] <= 50).all() and (rows[source == 1] > 100).all())


def test_resume_at_another_world_size_and_probe_of_earlier_batches(sources):
    data = mixed(sources, "a=0.6,b=0.4")
    expected = oracle_rows(data, 10, [0.6, 0.4])
    first = loader(data, 1)
    for _ in range(4):
        step_rows([first])
    state = first.state_dict()
    for W in (2, 4):
        resumed = [loader(data, W, r) for r in range(W)]
        for ld in resumed:
            ld.load_state_dict(state)
        assert resumed[0].changed is None
        for k in range(4, 10):
            np.testing.assert_array_equal(step_rows(resumed), expected[k], err_msg=f"W={W}")
        probe = torch.cat([torch.cat([x, y[:, -1:]], 1) for x, y in resumed[0].batch(1)])
        b = resumed[0].micro_batch
        mine = [i for m in range(G // (W * b)) for i in range(m * W * b, m * W * b + b)]
        np.testing.assert_array_equal(probe.numpy(), expected[1][mine])


def test_a_changed_mixture_on_resume_is_applied_from_there_and_recorded(sources):
    data = mixed(sources, "a=0.5,c=0.5")
    first = loader(data)
    for _ in range(3):
        step_rows([first])
    used = first.taken(3)
    changed = loader(mixed(sources, "a=0.25,c=0.75"), 2)
    again = loader(mixed(sources, "a=0.25,c=0.75"), 2, 1)
    for ld in (changed, again):
        ld.load_state_dict(first.state_dict())
    assert changed.changed == {"old": {"a": 0.5, "c": 0.5}, "new": {"a": 0.25, "c": 0.75}}
    source = np.concatenate([changed.rows(k)[0] for k in range(3, 103)])
    assert abs((source == 0).mean() - 0.25) <= 0.01
    # each source's cursor goes on where it stood: its next windows are its order's next ones
    _, windows = changed.rows(3)
    a_next = windows[changed.rows(3)[0] == 0][0]
    assert a_next == order.epoch_order(40, 5, 0).items(used[0], used[0] + 1)[0]
    # the batches read before the change read the same again (a probe), and the state says both
    np.testing.assert_array_equal(changed.rows(1)[1], first.rows(1)[1])
    assert len(changed.state_dict()["stretches"]) == 2
    step_rows([changed, again])
    assert changed.batch_index == 4


def test_refusals_on_resume(sources):
    data = mixed(sources, "a=0.5,c=0.5")
    state = loader(data).state_dict()
    with pytest.raises(DataError, match=r"resume with --data.seed 5"):
        loader(data, seed=6).load_state_dict(state)
    with pytest.raises(DataError, match="resume on the same datasets, in the same order"):
        loader(mixed(sources, "c=0.5,a=0.5")).load_state_dict(state)
    with pytest.raises(DataError, match="trained on one dataset, this run on a mixture"):
        loader(data).load_state_dict({"epoch": 0, "consumed": 0, "seed": 5})


def test_fingerprint_names_the_datasets_not_the_weights(sources):
    assert mixed(sources, "a=0.5,c=0.5").fingerprint == mixed(sources, "a=0.2,c=0.8").fingerprint
    assert mixed(sources, "a=0.5,c=0.5").fingerprint != mixed(sources, "a=0.5,b=0.5").fingerprint
    assert mixed(sources, "a=0.5,c=0.5").fingerprint != TokenDataset(sources["a"]).fingerprint


def test_datasets_must_share_a_tokenizer(sources, tmp_path):
    other = write_dataset(tmp_path / "g", np.arange(200) % 50, np.arange(50) % 50, 50257,
                          kind="gpt2")
    with pytest.raises(DataError) as e:
        open_data([(str(sources["a"]), 0.5), (str(other), 0.5)])
    assert str(e.value) == (f"data.dir: {sources['a']} and {other} have different tokenizers "
                            f"(byte, gpt2): a mixture's ids must mean the same text; prepare "
                            f"{other} again with --tokenizer-from {sources['a']}")


def test_one_dataset_under_two_spellings_or_two_copies_is_refused(sources, tmp_path,
                                                                  monkeypatch):
    """d1 and ./d1, d1/, a symlink to d1, or a copy of it: the same windows in the same order,
    so every batch would hold each window twice. One line, whichever way it is spelled."""
    import shutil

    a = sources["a"]
    monkeypatch.chdir(a.parent)
    (tmp_path / "link").symlink_to(a)
    shutil.copytree(a, tmp_path / "copy")
    for other, same in ((f"./{a.name}", "directory"), (f"{a.name}/", "directory"),
                        (str(tmp_path / "link"), "directory"),
                        (str(tmp_path / "copy"), "data (the same meta.json)")):
        with pytest.raises(DataError) as e:
            open_data(DataConfig(dir=f"{a.name}:0.5,{other}:0.5").sources())
        assert str(e.value) == (f"data.dir: {a.name} and {other} are the same {same}: the "
                                "mixture would train on each of its windows twice; give it "
                                "once, with its whole weight")
    assert len(open_data([(a.name, 0.5), (str(sources["b"]), 0.5)]).datasets) == 2


def test_names_are_the_directories_made_unique():
    assert unique_names(["data/a", "data/b"]) == ["a", "b"]
    assert unique_names(["x/web", "y/web"]) == ["x-web", "y-web"]
    assert unique_names(["x/web", "x/web/"]) == ["x-web", "x-web-2"]


def test_shares_sum_exactly():
    for weights in ([0.7, 0.3], [1 / 3] * 3, [1e-9, 1 - 1e-9], [0.1] * 10):
        got = shares([w / sum(weights) for w in weights])
        assert sum(got) == 10**6 and min(got) >= 1
        assert max(abs(g / 10**6 - w / sum(weights)) for g, w in zip(got, weights)) <= 1e-6


def test_a_mixture_of_packed_sources_reads_their_packed_rows_at_any_world_size(tmp_path):
    """data.align = bos in a mixture: every row of a step is a row of its source's packing (rows
    that start at documents), the same rows at W=1 and W=2; a state of the stream's rows is
    refused on resume."""
    from ddpgpt.data.packing import PackedRows
    rng = np.random.default_rng(1)
    dirs = []
    for k, name in enumerate("pq"):
        lengths = rng.integers(2, 3 * T, 120)
        stream = rng.integers(1 + 50 * k, 51 + 50 * k, int(lengths.sum()))
        stream[np.concatenate([[0], np.cumsum(lengths)[:-1]])] = 0  # each document's start
        dirs.append(write_dataset(tmp_path / name, stream, stream[:4 * T], 256, eot_id=0))
    data = open_data(DataConfig(dir=f"{dirs[0]}:0.7,{dirs[1]}:0.3").sources())
    packed = []
    for ds in data.datasets:
        rows = PackedRows(ds, "train", T)
        out = np.empty((rows.num_windows, T + 1), dtype=np.int64)
        rows.read(np.arange(rows.num_windows), out)
        packed.append({tuple(r) for r in out})

    def make(W, r):
        return MixtureLoader(data, seq_len=T, micro_batch=2, world_size=W, rank=r,
                             accum_steps=G // (W * 2), seed=5, align="bos")
    one, two = [make(1, 0)], [make(2, r) for r in range(2)]
    for _ in range(6):
        rows = step_rows(one)
        np.testing.assert_array_equal(rows, step_rows(two))
        for row in rows:
            source = 0 if row[row > 0].max() <= 50 else 1
            assert tuple(row) in packed[source]
    state = one[0].state_dict()
    assert state["align"] == "bos"
    stream = MixtureLoader(data, seq_len=T, micro_batch=2, world_size=1, rank=0,
                           accum_steps=G // 2, seed=5)
    with pytest.raises(DataError, match="data.align = bos"):
        stream.load_state_dict(state)

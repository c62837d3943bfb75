"""Rows that start at document starts (data.align = bos): the packing against its rules, the rows
against a naive slicer of the packing, and the loader's guarantees (W-invariance, exact resume at
another W) on packed rows."""

from collections import Counter

import numpy as np
import pytest

from ddpgpt.data import packing
from ddpgpt.data.loader import EvalLoader, TrainLoader
from ddpgpt.data.packing import PackedRows, doc_starts, pack
from ddpgpt.data.shards import TokenDataset
from ddpgpt.errors import DataError
from tests.helpers import write_dataset

T = 16
SEED = 7
EOT = 0


def documents(rng, n, longest):
    """n documents of random lengths 1..longest (end-of-text first, then distinct tokens)."""
    lengths = rng.integers(1, longest + 1, n)
    stream = np.arange(1, lengths.sum() + 1, dtype=np.int64)  # every token tells its position
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    stream[starts] = EOT
    return stream, starts


@pytest.fixture(scope="module")
def ds(tmp_path_factory):
    rng = np.random.default_rng(0)
    train, _ = documents(rng, 200, 3 * (T + 1))  # some longer than a row
    val, _ = documents(rng, 40, 2 * (T + 1))
    path = tmp_path_factory.mktemp("data") / "d"
    write_dataset(path, train, val, vocab_size=70_000, shard_tokens=1111, eot_id=EOT)
    return TokenDataset(path)


@pytest.mark.parametrize("longest", [5, T + 1, 4 * (T + 1)])
def test_packing_keeps_every_token_and_starts_rows_at_documents(longest):
    rng = np.random.default_rng(longest)
    stream, starts = documents(rng, 300, longest)
    span = T + 1
    piece_start, piece_len, row_ptr = pack(starts, len(stream), span, lookahead=20)
    rows = len(row_ptr) - 1
    assert rows == len(stream) // span or rows == len(stream) // span - 1
    covered = np.zeros(len(stream), dtype=int)
    carry = None  # where the continuation of the row before must begin
    for r in range(rows):
        pieces = range(row_ptr[r], row_ptr[r + 1])
        assert sum(piece_len[p] for p in pieces) == span
        for i, p in enumerate(pieces):
            s, n = int(piece_start[p]), int(piece_len[p])
            covered[s:s + n] += 1
            doc = np.searchsorted(starts, s, side="right") - 1
            end = starts[doc + 1] if doc + 1 < len(starts) else len(stream)
            assert s + n <= end  # a piece lies inside one document
            if i == 0 and carry is not None:
                assert s == carry  # the continuation starts the next row
            else:
                assert stream[s] == EOT  # every other piece begins at a document start
        last = int(piece_start[row_ptr[r + 1] - 1] + piece_len[row_ptr[r + 1] - 1])
        doc = np.searchsorted(starts, last - 1, side="right") - 1
        end = starts[doc + 1] if doc + 1 < len(starts) else len(stream)
        carry = last if last < end else None
    assert covered.max() == 1  # no token twice
    assert len(stream) - covered.sum() < span  # only the last, partial row is dropped


def test_rows_match_the_packing_and_the_cache(ds):
    rows = PackedRows(ds, "train", T)
    cache = ds.path / f"packing-train-{T + 1}.npz"
    assert cache.is_file()
    stream = np.concatenate(ds.tokens("train")).astype(np.int64)
    starts = doc_starts(rows.stream, EOT)
    assert np.array_equal(starts, np.flatnonzero(stream == EOT))
    want = pack(starts, len(stream), T + 1)
    for got, ref in zip((rows.piece_start, rows.piece_len, rows.row_ptr), want):
        assert np.array_equal(got, ref)
    out = np.empty((rows.num_windows, T + 1), dtype=np.int64)
    rows.read(np.arange(rows.num_windows), out)
    for r in range(rows.num_windows):
        ref = np.concatenate([stream[s:s + n] for s, n in zip(
            want[0][want[2][r]:want[2][r + 1]], want[1][want[2][r]:want[2][r + 1]])])
        assert np.array_equal(out[r], ref)
    again = PackedRows(ds, "train", T)  # from the cache file
    assert np.array_equal(again.row_ptr, rows.row_ptr)
    stats = rows.stats()
    assert stats["in_rows"] + stats["dropped"] == stats["tokens"] == len(stream)
    assert stats["dropped"] < T + 1


def test_a_stale_cache_is_packed_again(ds, tmp_path, monkeypatch):
    rows = PackedRows(ds, "val", T)
    cache = ds.path / f"packing-val-{T + 1}.npz"
    with np.load(cache) as saved:
        arrays = dict(saved)
    arrays["key"] = np.array("1 another-dataset 17")
    arrays["row_ptr"] = arrays["row_ptr"][:2]
    np.savez(cache, **arrays)
    assert np.array_equal(PackedRows(ds, "val", T).row_ptr, rows.row_ptr)
    monkeypatch.setattr(packing, "pack", lambda *a, **k: pytest.fail("packed again"))
    PackedRows(ds, "val", T)  # the rewritten cache is read


def test_a_shard_rewritten_in_place_with_its_time_set_back_is_packed_again(tmp_path):
    """meta.json unchanged (with --data.verify false nothing hashes the shards): the cache is
    keyed by the shards' identities too, whose change time no call sets back, so the rows are
    those of the bytes on the disk, not the packing of the bytes before."""
    import os

    rng = np.random.default_rng(1)
    train, _ = documents(rng, 60, 2 * (T + 1))
    path = write_dataset(tmp_path / "d", train, train[:3 * (T + 1)], vocab_size=70_000,
                         eot_id=EOT)
    before = PackedRows(TokenDataset(path), "train", T)
    shard = path / TokenDataset(path).shards["train"][0].file
    stat = shard.stat()
    raw = np.frombuffer(shard.read_bytes(), dtype=np.uint8).copy()
    tokens = raw[1024:].view(np.uint32)  # past the header: one document in two is merged
    tokens[np.flatnonzero(tokens == EOT)[1::2]] = 1
    with open(shard, "r+b") as f:
        f.write(raw.tobytes())
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    ds = TokenDataset(path)
    after = PackedRows(ds, "train", T)
    want = pack(np.flatnonzero(tokens == EOT), len(tokens), T + 1)
    assert not np.array_equal(before.piece_start, want[0])
    for got, ref in zip((after.piece_start, after.piece_len, after.row_ptr), want):
        assert np.array_equal(got, ref)


@pytest.mark.parametrize("eots, said", [(0, True), (1, True), (2, False)])
def test_rows_packed_from_one_document_are_said(tmp_path, eots, said):
    """No end-of-text token, or one at the start: the split is one document, its packed rows
    are slices of it (their first tokens are no document starts). Two documents: nothing to say;
    the stream never is."""
    from ddpgpt.data.mixture import MixedDataset, MixtureLoader, packing_notes

    tokens = np.arange(1, 400) % 50 + 1
    tokens[[0, 200][:eots]] = EOT
    path = write_dataset(tmp_path / "d", tokens, tokens[:3 * (T + 1)], vocab_size=70_000,
                         eot_id=EOT)
    rows = PackedRows(TokenDataset(path), "train", T)
    assert rows.documents == max(1, eots)
    notes, none = packing_notes(TrainLoader(TokenDataset(path), seq_len=T, micro_batch=2,
                                            align="bos"))
    assert none == []  # no conversations
    assert notes == ([f"data.align bos: the train split of dataset {path} is one document (no "
                      f"end-of-text token, id {EOT}, between its tokens), so every row is a "
                      "slice of it and model.doc_mask masks nothing; prepare the data with its "
                      "documents apart (ddpgpt prepare puts an end-of-text token before each), "
                      "or use --data.align stream"] if said else [])
    assert PackedRows(TokenDataset(path), "train", T).documents == rows.documents  # cached
    assert packing_notes(TrainLoader(TokenDataset(path), seq_len=T, micro_batch=2)) == ([], [])
    other = write_dataset(tmp_path / "e", np.where(np.arange(400) % 20, 3, EOT),
                          tokens[:3 * (T + 1)], vocab_size=70_000, eot_id=EOT)
    mix = MixtureLoader(MixedDataset([(str(path), 0.5), (str(other), 0.5)]), seq_len=T,
                        micro_batch=2, align="bos")
    assert packing_notes(mix)[0] == notes


@pytest.mark.parametrize("damage", [b"", b"not a zip", b"PK\x03\x04 cut short"])
def test_a_damaged_cache_is_packed_again(ds, damage):
    rows = PackedRows(ds, "val", T)
    (ds.path / f"packing-val-{T + 1}.npz").write_bytes(damage)
    assert np.array_equal(PackedRows(ds, "val", T).row_ptr, rows.row_ptr)


def make(ds, W, A, b, r=0, **kw):
    return TrainLoader(ds, seq_len=T, micro_batch=b, world_size=W, rank=r, accum_steps=A,
                       seed=SEED, align="bos", **kw)


def step_rows(loaders) -> Counter:
    """One step of every rank's loader: the multiset of rows read (as tuples of tokens)."""
    seen = Counter()
    for loader in loaders:
        for x, y in loader.next_step():
            assert np.array_equal(x[:, 1:].numpy(), y[:, :-1].numpy())
            seen.update(tuple(row) + (int(last),) for row, last in zip(x.tolist(), y[:, -1]))
    return seen


def test_world_size_invariance_and_every_row_once_per_epoch(ds):
    per_config = []
    for W, A in ((1, 4), (2, 2), (4, 1)):
        loaders = [make(ds, W, A, 2, r) for r in range(W)]
        per_config.append([step_rows(loaders) for _ in range(2 * loaders[0].steps_per_epoch)])
    assert per_config[0] == per_config[1] == per_config[2]
    loader = make(ds, 1, 1, 8)
    rows = PackedRows(ds, "train", T)
    epoch = sum(per_config[0][:loader.steps_per_epoch], Counter())
    assert sum(epoch.values()) == loader.steps_per_epoch * 8
    assert max(epoch.values()) == 1 and len(epoch) <= rows.num_windows


def test_resume_same_and_other_world_size(ds):
    n, k = 25, 9
    straight = [make(ds, 2, 3, 2, r) for r in range(2)]
    reference = [step_rows(straight) for _ in range(n)]
    for W2, A2, b2 in ((2, 3, 2), (3, 1, 4), (1, 6, 2)):
        first = [make(ds, 2, 3, 2, r) for r in range(2)]
        head = [step_rows(first) for _ in range(k)]
        state = first[0].state_dict()
        assert state["align"] == "bos" and state["version"] == 3
        second = [make(ds, W2, A2, b2, r) for r in range(W2)]
        for loader in second:
            loader.load_state_dict(state)
        assert head + [step_rows(second) for _ in range(n - k)] == reference


def test_state_of_another_align_is_refused_and_old_states_are_the_streams(ds):
    stream = TrainLoader(ds, seq_len=T, micro_batch=4, seed=SEED)
    state = stream.state_dict()
    with pytest.raises(DataError, match="data.align = stream, this run has bos: resume with "
                                        "--data.align stream"):
        make(ds, 1, 1, 4).load_state_dict(state)
    del state["align"]  # a checkpoint of before data.align
    state["version"] = 2
    TrainLoader(ds, seq_len=T, micro_batch=4, seed=SEED).load_state_dict(state)
    with pytest.raises(DataError, match="data.align = stream"):
        make(ds, 1, 1, 4).load_state_dict(state)


@pytest.mark.parametrize("W", [2, 3])
def test_val_rows_split_across_ranks(ds, W):
    def rows(loader):
        return [tuple(r) for x, y in loader for r, t in zip(x.tolist(), y.tolist()) if t[0] >= 0]

    single = rows(EvalLoader(ds, seq_len=T, micro_batch=4, align="bos"))
    split = [rows(EvalLoader(ds, seq_len=T, micro_batch=4, world_size=W, rank=r, align="bos"))
             for r in range(W)]
    assert Counter(single) == Counter(r for part in split for r in part)
    assert len(single) == PackedRows(ds, "val", T).num_windows

"""The sharded checkpoint's pieces, against torch.distributed.checkpoint on one process: chunks
that tile each tensor, resharding between any two chunkings, the writers' balance, and what
loading refuses (pickled objects, an index with anything but DCP's own classes)."""

import json
import os
import pickle
import shutil
import stat

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ddpgpt.checkpoint import read, sharded, store
from ddpgpt.checkpoint.store import CheckpointError
from ddpgpt.errors import UserError
from tests.helpers import SMALL, save_format_2


@pytest.mark.parametrize("shape", [(7,), (5, 6), (1, 9), (9, 1)])
def test_flat_ranges_are_rectangles_that_tile_the_range(shape):
    """Every range of a tensor's flattened elements, as flat_range cuts it: at most three
    rectangles, views of the flat piece, which together are exactly those elements."""
    full = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).view(shape)
    n = full.numel()
    for start in range(n):
        for end in range(start + 1, n + 1):
            flat = full.reshape(-1)[start:end].clone()
            pieces = sharded.flat_range(full.shape, flat, start)
            assert len(pieces.chunks) <= 3
            seen = torch.zeros(n, dtype=torch.bool)
            for offsets, t in pieces.chunks:
                assert t.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
                index = tuple(slice(o, o + s) for o, s in zip(offsets, t.shape))
                assert torch.equal(full[index], t)
                mask = torch.zeros(shape, dtype=torch.bool)
                mask[index] = True
                assert not (seen & mask.view(-1)).any()
                seen |= mask.view(-1)
            assert seen.nonzero().view(-1).tolist() == list(range(start, end))


def slices(full: torch.Tensor, cuts: list[int]) -> list[sharded.Pieces]:
    """`full` as zero1 holds it: one contiguous range of its flattened elements per 'rank'."""
    flat = full.reshape(-1)
    return [sharded.flat_range(full.shape, flat[a:b].clone(), a) for a, b in zip(cuts, cuts[1:])]


def merged(parts: list[sharded.Pieces]) -> sharded.Pieces:
    return sharded.Pieces(parts[0].shape, [c for p in parts for c in p.chunks])


def test_any_chunking_loads_any_other(tmp_path):
    """Saved as uneven zero1-style ranges, loaded as row bands (fsdp2's Shard(0)) and as one whole
    tensor, in place: DCP's resharding over our chunks gives back every element."""
    a, b = torch.randn(6, 5), torch.randn(11)
    saved = {"a": merged(slices(a, [0, 7, 13, 30])), "b": merged(slices(b, [0, 4, 11]))}
    sharded.save(saved, tmp_path / "ck", None)
    index = sharded.parse_index((tmp_path / "ck" / sharded.INDEX).read_bytes())
    bands = [torch.empty(2, 5) for _ in range(3)]
    whole_b = torch.empty(11)
    sharded.load({"a": sharded.Pieces(a.shape, [((2 * i, 0), t) for i, t in enumerate(bands)]),
                  "b": sharded.whole(whole_b)}, tmp_path / "ck", index, None)
    assert torch.equal(torch.cat(bands), a) and torch.equal(whole_b, b)
    assert torch.equal(sharded.read_whole(tmp_path / "ck", index, "")["a"], a)


def test_writers_balance_replicated_tensors():
    """Largest first to the least loaded rank: deterministic, and no rank above 1/W of the bytes
    plus the largest tensor."""
    sizes = {f"t{i}": s for i, s in enumerate([100, 7, 64, 64, 3, 90, 12, 50, 50, 1])}
    for world in (1, 2, 3, 4, 8):
        owner = sharded.writers(sizes, world)
        assert owner == sharded.writers(dict(reversed(sizes.items())), world)
        load = [sum(s for k, s in sizes.items() if owner[k] == r) for r in range(world)]
        assert sum(load) == sum(sizes.values())
        assert max(load) <= sum(sizes.values()) / world + max(sizes.values())


def test_pickled_objects_are_refused(tmp_path):
    """DCP would read a non-tensor entry with torch.load(weights_only=False); we refuse it."""
    with pytest.warns(UserWarning):
        dcp.save({"x": 1}, checkpoint_id=tmp_path / "ck", no_dist=True)
    index = sharded.parse_index((tmp_path / "ck" / sharded.INDEX).read_bytes())
    with pytest.raises(BaseException) as e:
        sharded.load({"x": sharded.whole(torch.zeros(1))}, tmp_path / "ck", index, None)
    assert any(isinstance(exc, UserError) and "pickled object" in str(exc)
               for _, exc in sharded.failures(e.value))


def test_an_index_runs_no_code():
    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    with pytest.raises(pickle.UnpicklingError, match="posix.system is not part of"):
        sharded.parse_index(pickle.dumps(Evil()))
    with pytest.raises(pickle.UnpicklingError, match="holds a Metadata, not a dict"):
        sharded.parse_index(pickle.dumps({}))


def test_a_foreign_index_with_a_matching_hash_is_one_line(tmp_path):
    from ddpgpt.model.gpt import GPT

    path = store.save(tmp_path, 1, {"model": GPT(SMALL).state_dict()}, {}, keep=5)
    data = pickle.dumps({"not": "an index"})
    (path / sharded.INDEX).write_bytes(data)
    meta = json.loads((path / "meta.json").read_text())
    meta["files"][sharded.INDEX] = __import__("hashlib").sha256(data).hexdigest()
    (path / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=r"\.metadata is not an index of tensors"):
        read.load(path, store.read_meta(path))


# ---- format 2: written whole by rank 0, still read ------------------------------------------

def test_format_2_still_loads_and_format_3_follows(tmp_path):
    """A run dir whose older checkpoint is format 2: found, verified and loaded whole; the next
    save writes format 3 beside it and becomes the newest."""
    from ddpgpt.model.gpt import GPT

    root = tmp_path / "checkpoints"
    weights = GPT(SMALL, seed=3).state_dict()
    old = save_format_2(root, 1, {"model": weights, "optimizer": {"step": 1}}, {"world_size": 2})
    path, meta = store.find_latest(root)
    assert (path, meta["format_version"]) == (old, 2)
    state = read.load(path, meta)
    assert state["optimizer"] == {"step": 1}
    assert all(torch.equal(state["model"][k], v) for k, v in weights.items())
    assert all(torch.equal(read.weights(old)[k], v) for k, v in weights.items())
    store.save(root, 2, {"model": weights}, {}, keep=5)
    path, meta = store.find_latest(root)
    assert (path.name, meta["format_version"]) == ("step_0000002", 3)
    shutil.rmtree(path)


def test_export_writes_one_safetensors_file(tmp_path):
    from safetensors.torch import load_file

    from ddpgpt.model.gpt import GPT

    weights = GPT(SMALL, seed=4).state_dict()
    path = store.save(tmp_path, 1, {"model": weights}, {}, keep=5)
    old = os.umask(0o027)  # a group-readable umask: the file is 0640, as open() would make it
    try:
        out = read.export_safetensors(path, tmp_path / "model.safetensors")
    finally:
        os.umask(old)
    loaded = load_file(out)
    assert loaded.keys() == weights.keys()
    assert all(torch.equal(loaded[k], v) for k, v in weights.items())
    assert stat.S_IMODE(out.stat().st_mode) == 0o640


def test_a_one_process_save_and_load_warn_nothing(tmp_path):
    """DCP's "assuming the intent is to save in a single process" is silenced at its source (it
    used to cross the progress bar at every checkpoint of a one-process run); other warnings are
    not."""
    import warnings

    state = {"w": sharded.whole(torch.arange(6.0))}
    with warnings.catch_warnings(record=True) as caught:  # the filters as they are
        writer = sharded.save(state, tmp_path / "ck", None)
        index = sharded.parse_index((tmp_path / "ck" / sharded.INDEX).read_bytes())
        target = {"w": sharded.whole(torch.zeros(6))}
        sharded.load(target, tmp_path / "ck", index, None)
        warnings.warn("something else", UserWarning, stacklevel=1)
    assert writer.files and torch.equal(target["w"].chunks[0][1], torch.arange(6.0))
    assert [str(w.message) for w in caught] == ["something else"]

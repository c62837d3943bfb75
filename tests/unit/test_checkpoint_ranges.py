"""A checkpoint restored from object storage with its byte ranges fetched concurrently
(checkpoint/ranges.py): the same tensors as saved, every range the load needs asked for in one
batch of GETs (not read one after the other through a stream), in batches of BATCH bytes."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from ddpgpt.checkpoint import ranges, read, store
from ddpgpt.config.model import ModelConfig
from ddpgpt.model.gpt import GPT


def test_spans_read_what_the_file_holds_across_chunks():
    data = np.random.default_rng(0).integers(0, 256, 1000, dtype=np.uint8).tobytes()
    spans = ranges.Spans([(600, data[600:1000]), (100, data[100:350]), (350, data[350:600])])
    spans.seek(120)
    assert spans.read(400) == data[120:520]  # across three chunks
    assert spans.tell() == 520
    spans.seek(-10, os.SEEK_END)
    assert spans.read() == data[990:]
    spans.seek(5, os.SEEK_SET)
    with pytest.raises(OSError, match="byte 5 of a checkpoint file was not fetched"):
        spans.read(10)


@pytest.mark.parametrize("batch", [ranges.BATCH, 64 << 10])
def test_a_restore_from_a_url_fetches_its_ranges_in_batches_and_reads_the_saved_tensors(
        s3, monkeypatch, batch):
    root = s3.bucket("ranges") + "/run"
    weights = GPT(ModelConfig(n_layer=2, n_head=2, n_embd=64, block_size=16,
                              vocab_size=512)).state_dict()
    size = sum(v.numel() * v.element_size() for v in weights.values())  # 0.5 MB
    path = store.save(root, 3, {"model": weights, "optimizer": {"step": 3}}, {"config": {}}, 5)
    monkeypatch.setattr(ranges, "CHUNK", 4096)  # many GETs a tensor: the biggest is 128 KiB
    monkeypatch.setattr(ranges, "BATCH", batch)
    calls, real = [], ranges.read_data

    def counting(reader, plan, planner, parent):
        fs = reader.fs.fs
        fetch = fs.cat_ranges  # fsspec's concurrent one, bound to the client
        monkeypatch.setattr(fs, "cat_ranges", lambda paths, *a, **k: calls.append(len(paths))
                            or fetch(paths, *a, **k))
        return real(reader, plan, planner, parent)

    monkeypatch.setattr(ranges, "read_data", counting)
    got = read.load(path, store.read_meta(path))["model"]
    assert all(torch.equal(got[k], v) for k, v in weights.items())
    assert sum(calls) >= size // 4096  # each tensor cut into CHUNK-byte GETs
    if batch > size:
        assert len(calls) == 1  # all of them asked for at once
    else:
        assert len(calls) >= size // batch  # at most BATCH bytes (and one tensor) at a time

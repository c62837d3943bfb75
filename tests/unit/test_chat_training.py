"""Fine-tuning on conversations in one process: conversations packed whole, each row's targets
following its mask, the loss normalized by the global count of unmasked targets (against a
one-forward oracle, and against the per-micro-batch mean, which is another loss), an all-ones
mask reducing to the plain loss, and an exact resume. The same at W = 2 and 4 and in every
sync mode: tests/dist/test_chat.py."""

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ddpgpt.config.io import build
from ddpgpt.data.loader import TrainLoader
from ddpgpt.data.packing import PackedRows, conversations_note, pack
from ddpgpt.data.shards import TokenDataset
from ddpgpt.distributed.group import DistEnv
from ddpgpt.guard.health import Guard, StopSignal
from ddpgpt.optim.schedule import Rates
from ddpgpt.run.preflight import preflight
from ddpgpt.trainer import Trainer
from tests.helpers import write_dataset

T = 32
RATES = Rates(1e-2, 0.95)


def trainer(data, tmp_path, b=2, G=8, clip=1.0, **data_flags) -> Trainer:
    flags = {"model": {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": T},
             "data": {"dir": str(data), "micro_batch": b, "global_batch": G,
                      "eval_windows": 4, **data_flags},
             "optim": {"grad_clip": clip},
             "run": {"dir": str(tmp_path / "run"), "device": "cpu", "threads": 1}}
    cfg, dataset = preflight(build(None, None, flags), 1, 1)
    env = DistEnv()
    return Trainer(cfg, env, dataset, Guard(env, cfg.run, StopSignal(announce=False)))


def rows_of(ds: TokenDataset, rows: PackedRows, r: int) -> tuple[np.ndarray, np.ndarray]:
    """Row r's tokens and mask straight from the split's shards and the packing's pieces
    (padding: end-of-text, mask 0)."""
    tokens = np.concatenate(ds.tokens("train")).astype(np.int64)
    masks = np.concatenate(ds.tokens("train", masks=True))
    out, mask = [], []
    for p in range(rows.row_ptr[r], rows.row_ptr[r + 1]):
        s, n = int(rows.piece_start[p]), int(rows.piece_len[p])
        out.append(tokens[s:s + n] if s >= 0 else np.full(n, ds.eot_id))
        mask.append(masks[s:s + n] if s >= 0 else np.zeros(n, np.uint8))
    return np.concatenate(out), np.concatenate(mask)


def test_each_rows_targets_are_its_tokens_where_the_mask_is_one(chat_data):
    ds = TokenDataset(chat_data)
    loader = TrainLoader(ds, seq_len=T, micro_batch=4, accum_steps=2, align="bos")
    assert loader.masked
    step = loader.order(0).items(0, 8)
    for m, (x, y) in enumerate(loader.next_step()):
        for i, r in enumerate(step[4 * m:4 * m + 4]):
            tokens, mask = rows_of(ds, loader.stream, int(r))
            assert x[i].tolist() == tokens[:-1].tolist()
            assert y[i].tolist() == np.where(mask[1:] == 1, tokens[1:], -1).tolist()


@pytest.mark.parametrize("longest", [20, 40])
def test_conversations_are_packed_whole_and_only_longer_ones_split(longest):
    rng = np.random.default_rng(longest)
    lengths = rng.integers(2, longest + 1, 300)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    span = T + 1
    piece_start, piece_len, row_ptr = pack(starts, int(lengths.sum()), span, lookahead=20,
                                           whole=True)
    covered = np.zeros(int(lengths.sum()), dtype=int)
    for r in range(len(row_ptr) - 1):
        pieces = range(row_ptr[r], row_ptr[r + 1])
        assert sum(piece_len[p] for p in pieces) == span
        pads = [p for p in pieces if piece_start[p] < 0]
        assert pads in ([], [pieces[-1]])  # padding only ends a row
        for p in pieces:
            if piece_start[p] < 0:
                continue
            s, n = int(piece_start[p]), int(piece_len[p])
            covered[s:s + n] += 1
            doc = np.searchsorted(starts, s, side="right") - 1
            if lengths[doc] <= span:  # a conversation that fits a row is in one piece, whole
                assert (s, n) == (starts[doc], lengths[doc])
    assert (covered == 1).all()  # every token once: none dropped, the last row padded


def test_the_start_says_how_many_conversations_are_split(chat_data):
    rows = PackedRows(TokenDataset(chat_data), "train", T)
    long = int(np.count_nonzero(np.diff(np.append(
        np.flatnonzero(np.concatenate(TokenDataset(chat_data).tokens("train")) == 256),
        rows.num_tokens)) > T + 1))
    assert 0 < long < rows.documents == 270
    pad = int(rows.piece_len[rows.piece_start < 0].sum())
    assert conversations_note(rows) == (
        f"the train split of {chat_data}: {long} of 270 conversations are longer than a row of "
        "33 tokens, each split across rows with its mask (their later rows do not see their "
        f"start); padding is {pad / (rows.num_windows * 33):.1%} of the rows' "
        f"{rows.num_windows} × 33 tokens")


def oracle(model, batches) -> tuple[float, list[torch.Tensor]]:
    """The sum of every unmasked target's loss over the whole global batch, divided by their
    number: one forward over all its rows at once, and its gradients."""
    x = torch.cat([b[0] for b in batches])
    y = torch.cat([b[1] for b in batches])
    model.zero_grad()
    logits, _ = model(x)
    loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1), ignore_index=-1,
                           reduction="sum") / (y >= 0).sum()
    loss.backward()
    return loss.item(), [p.grad.clone() for p in model.parameters()]


def per_micro_batch_mean(model, batches) -> float:
    """nanochat's SFT loss: each micro-batch's mean over its own unmasked targets, / A (a
    micro-batch without any: 0 here; its mean is NaN)."""
    return sum(model(x, y)[1].item() for x, y in batches if (y >= 0).any()) / len(batches)


def test_the_loss_is_the_global_batchs_sum_over_its_unmasked_count(chat_data, tmp_path):
    """train_step at b = 1, 2 and 8 (A = 8, 4, 1): the oracle's loss and gradients; the
    per-micro-batch mean on the same rows is another loss at b = 1 and 2."""
    losses, means = {}, {}
    for b in (1, 2, 8):
        t = trainer(chat_data, tmp_path / str(b), b=b, clip=0.0)  # the gradients unclipped
        batches = list(t.loader.batch(0))
        want, grads = oracle(t.raw, batches)
        t.sync.zero_grad()
        loss, _ = t.train_step()
        losses[b] = loss.item()
        assert loss.item() == pytest.approx(want, rel=1e-6)
        for p, g in zip(t.raw.parameters(), grads):
            torch.testing.assert_close(p.grad, g, rtol=1e-5, atol=1e-7)
        with torch.no_grad():
            means[b] = per_micro_batch_mean(t.raw, batches)
    assert losses[1] == pytest.approx(losses[8], rel=1e-6)
    assert means[8] == pytest.approx(losses[8], rel=1e-6)  # one micro-batch: the same
    for b in (1, 2):  # at init every token's loss is near ln V: apart by ~1e-3, 1000 × the tol
        assert abs(means[b] - losses[b]) > 1e-4 * losses[b], (b, means[b], losses[b])


def test_an_all_ones_mask_trains_as_the_plain_loss(tmp_path):
    rng = np.random.default_rng(0)
    train, val = rng.integers(0, 60, 3000), rng.integers(0, 60, 600)
    plain = write_dataset(tmp_path / "plain", train, val, 64)
    ones = write_dataset(tmp_path / "ones", train, val, 64,
                         masks=(np.ones(len(train)), np.ones(len(val))))
    runs = {}
    for name, data in (("plain", plain), ("ones", ones)):
        t = trainer(data, tmp_path / name, align="stream")
        runs[name] = []
        for _ in range(4):
            loss, _ = t.train_step()
            t.update(RATES)
            runs[name].append(loss.item())
        assert t.loader.masked == (name == "ones")
    # float tolerance, not bitwise: the plain path takes cross-entropy's mean over b·T and
    # divides by A; the masked one its sum times W / N (measured: within 3e-7 relative)
    np.testing.assert_allclose(runs["ones"], runs["plain"], rtol=1e-6, atol=0)


def test_a_fine_tune_resumes_exactly(chat_data, tmp_path):
    def steps(t, n):
        out = []
        for _ in range(n):
            loss, _ = t.train_step()
            t.update(RATES)
            t.step += 1
            out.append(loss.item())
        return out

    straight = steps(trainer(chat_data, tmp_path / "a"), 4)
    first = trainer(chat_data, tmp_path / "b")
    head = steps(first, 2)
    state = copy.deepcopy(first.state_dict())
    second = trainer(chat_data, tmp_path / "c")
    second.load_state_dict(state, saved_world_size=1)
    assert head + steps(second, 2) == straight  # bitwise: the same W, the same arithmetic


def test_a_dataset_of_conversations_in_object_storage_reads_as_its_local_copy(chat_data, s3):
    """Its masks travel with its tokens: the same rows and targets from a bucket (ranged reads)
    as from the disk, the packing included."""
    url = s3.bucket("chat") + "/chat"
    fs = s3.fs()
    for path in sorted(chat_data.iterdir(), key=lambda p: p.name == "meta.json"):
        if path.suffix in (".bin", ".mask", ".json") and path.name != "verified.json":
            fs.put_file(str(path), f"{url[5:]}/{path.name}")
    remote = TokenDataset(url)
    assert remote.masked and remote.fingerprint == TokenDataset(chat_data).fingerprint
    loaders = [TrainLoader(ds, seq_len=T, micro_batch=4, accum_steps=2, align="bos")
               for ds in (remote, TokenDataset(chat_data))]
    for (x, y), (x0, y0) in zip(*(loader.next_step() for loader in loaders)):
        assert torch.equal(x, x0) and torch.equal(y, y0)

"""model.attention flex: FlexAttention under one block mask per batch gives what SDPA gives under
the dense mask (documents that cross row starts, the sliding band, grouped-query heads, both
archs), compiled or not; where it cannot run it says so in one line; and the weights, sampling
and export do not depend on it.

On a CPU torch (2.13) runs FlexAttention's forward only: the gradients through model/flex_cpu.py's
backward are compared in tests/unit/test_flex_cpu.py, torch's own on CUDA in tests/gpu."""

from __future__ import annotations

import copy
import dataclasses
import json
import sys

import numpy as np
import pytest
import torch

from ddpgpt.checkpoint import store
from ddpgpt.checkpoint.read import load_model
from ddpgpt.cli import main
from ddpgpt.config.io import from_dict
from ddpgpt.config.schema import DataConfig, TrainConfig
from ddpgpt.data.shards import TokenDataset
from ddpgpt.model import flex
from ddpgpt.model.attention import CausalSelfAttention, band, documents, mask_for
from ddpgpt.model.gpt import GPT
from ddpgpt.model.layers import rotary
from ddpgpt.run import changes, resume
from ddpgpt.run.preflight import resolve
from ddpgpt.run.run_dir import RunDir
from tests.helpers import SMALL, assert_greedy_agrees, write_dataset

pytestmark = pytest.mark.usefixtures("one_thread")
BOS = 1
ARCHS = {"gpt2": dataclasses.replace(SMALL, bos_id=BOS, doc_mask=True),
         "modern": dataclasses.replace(SMALL, arch="modern", n_head=4, bos_id=BOS,
                                       doc_mask=True)}


@pytest.fixture
def uncompiled():
    """FlexAttention without torch.compile (the same numbers; a compile is ~5 s a shape on a
    CPU): as `attend` runs it where the compiler fails."""
    with flex.uncompiled("cpu"):
        yield


def rows(B: int, T: int, every: int, seed: int = 0) -> torch.Tensor:
    """(B, T) ids with a document start (BOS) about every `every` tokens, never at a row's first
    token: each row begins inside a document that started before it."""
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(2, SMALL.vocab_size, (B, T), generator=gen)
    starts = torch.rand(B, T, generator=gen) < 1 / every
    starts[:, 0] = False
    idx[starts] = BOS
    return idx


def perturbed(model: GPT) -> GPT:
    """Weights away from init (zero projections would hide any difference in attention)."""
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(1 + 0.3 * torch.randn(p.shape, generator=gen) if p.dim() == 1
                    else 0.2 * torch.randn(p.shape, generator=gen))
    return model


def layer_pair(n_head: int, n_kv_head: int, device: str = "cpu"):
    """One attention layer of head width 16, and q, k, v-producing input."""
    cfg = dataclasses.replace(SMALL, n_embd=64, n_head=n_head, n_kv_head=n_kv_head,
                              head_dim=16).resolved()
    torch.manual_seed(0)
    return CausalSelfAttention(cfg).to(device)


def compare_layer(layer, idx, window: int, grads: bool):
    """The layer's output (and its input's and weights' gradients) under the dense mask and under
    the block mask; the largest differences, relative to the largest value compared."""
    x = torch.randn(*idx.shape, 64, generator=torch.Generator().manual_seed(1)).to(idx.device)
    T = idx.size(1)
    dense = documents(idx, BOS, band(T, window, idx.device) if window else None)
    block = flex.block_mask(idx, BOS, window)
    outs = []
    for mask in (dense, block):
        x_ = x.clone().requires_grad_(grads)
        layer.zero_grad()
        y = layer(x_, mask=mask)
        got = [y]
        if grads:
            y.square().sum().backward()
            got += [x_.grad, layer.qkv.weight.grad, layer.proj.weight.grad]
        outs.append(got)
    return [((a - b).abs().max() / b.abs().max()).item() for a, b in zip(*outs)]


@pytest.mark.parametrize("window", [0, 70], ids=["documents", "documents+band"])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
def test_the_block_mask_gives_the_dense_mask_s_attention(uncompiled, heads, window):
    """300 tokens: 3 blocks of 128 a side, so whole blocks are skipped, kept whole and cut
    (documents of ~40 tokens, a band of 70), and the last block is partial."""
    layer = layer_pair(*heads)
    with torch.no_grad():
        (diff,) = compare_layer(layer, rows(3, 300, 40), window, grads=False)
    assert diff <= 1e-5


@pytest.mark.parametrize("arch, kv, window", [
    ("gpt2", 0, 0), ("gpt2", 2, 0), ("modern", 0, 0), ("modern", 2, 0),
    ("modern", 0, 5), ("modern", 2, 5)])  # a band (window) needs rotary positions
def test_the_model_s_logits_are_sdpa_s(uncompiled, arch, kv, window):
    """Rows of 16 tokens with documents of ~4 that cross row starts; the sliding band of 5."""
    cfg = dataclasses.replace(ARCHS[arch], n_head=4, n_kv_head=kv)
    idx = rows(2, 16, 4)
    assert (idx[:, 1:] == BOS).any(1).all() and not (idx[:, 0] == BOS).any()
    with torch.no_grad():
        want = perturbed(GPT(dataclasses.replace(cfg, attention="sdpa"), seed=3).eval())
        got = perturbed(GPT(dataclasses.replace(cfg, attention="flex"), seed=3).eval())
        assert "cpu" in got.flex_on and not want.flex_on
        a, b = want(idx, window=window)[0], got(idx, window=window)[0]
    torch.testing.assert_close(b, a, rtol=0, atol=1e-5 * a.abs().max().item())
    assert a.abs().max() > 1  # logits worth comparing


@pytest.mark.slow
def test_compiled_flex_gives_the_dense_mask_s_attention():
    """torch.compile's kernel (a C++ one on a CPU: seconds a compile, so one shape), alone (an
    uncompiled model's) and inside a compiled layer (run.compile's) with QK-norm and the rotary
    turn before it, which torch 2.13's CPU kernel gets wrong unless its inputs are contiguous."""
    cfg = dataclasses.replace(ARCHS["modern"], n_embd=64, n_head=4, n_kv_head=2,
                              block_size=160).resolved()
    torch.manual_seed(0)
    layer = CausalSelfAttention(cfg)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in layer.parameters():  # QK-norm's gains away from one
            p.copy_(1 + 0.3 * torch.randn(p.shape, generator=gen) if p.dim() == 1
                    else 0.2 * torch.randn(p.shape, generator=gen))
        idx = rows(2, 160, 30)
        x = torch.randn(2, 160, 64, generator=gen)
        angles = rotary(torch.arange(160), cfg.head_dim, cfg.rope_theta)
        want = layer(x, angles, mask=documents(idx, BOS))
        alone = layer(x, angles, mask=flex.block_mask(idx, BOS))
        inside = torch.compile(layer)(x, angles, mask=flex.block_mask(idx, BOS))
    assert "cpu" not in flex._uncompiled
    for got in (alone, inside):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * want.abs().max().item())


def test_a_kernel_that_does_not_compile_falls_back_in_one_line(monkeypatch, capsys):
    def no_compiler(*args, **kwargs):  # what torch.compile's kernel does without a compiler
        raise RuntimeError("InvalidCxxCompiler: No working C++ compiler found\nmore")

    monkeypatch.setattr(flex, "_compiled", {"cpu": no_compiler})
    monkeypatch.setattr(flex, "_uncompiled", {})
    layer = layer_pair(4, 2)
    with torch.no_grad():
        idx = rows(2, 40, 10)
        with pytest.raises(ValueError, match="query and key/value"):  # the inputs' fault
            flex.attend(torch.zeros(1, 4, 40, 16), torch.zeros(1, 4, 40, 8),
                        torch.zeros(1, 4, 40, 8), flex.block_mask(idx[:1], BOS), gqa=False)
        assert flex._uncompiled == {} and capsys.readouterr().err == ""
        (diff,) = compare_layer(layer, idx, 0, grads=False)
        (again,) = compare_layer(layer, idx, 0, grads=False)
    err = capsys.readouterr().err
    assert err == ("ddpgpt: model.attention flex: torch.compile cannot build FlexAttention's "
                   "kernel on cpu (RuntimeError: InvalidCxxCompiler: No working C++ compiler "
                   "found); running it uncompiled, which materializes every score: the same "
                   "numbers, slower than model.attention sdpa\n")
    assert diff <= 1e-5 and again <= 1e-5


def test_without_flex_attention_flex_is_refused_and_auto_is_sdpa(monkeypatch):
    monkeypatch.setitem(sys.modules, flex.MODULE, None)  # as on torch < 2.5: the import fails
    why = flex.unavailable()
    assert why == (f"torch {torch.__version__} has no FlexAttention "
                   "(torch.nn.attention.flex_attention came with torch 2.5); upgrade torch")
    assert flex.choose("auto", "cuda") == flex.choose("auto", "cpu") == "sdpa"
    assert flex.refusal("cuda", 0.0) == (f"model.attention = flex: {why}, or use "
                                         "model.attention sdpa (or auto)")
    assert not GPT(dataclasses.replace(SMALL, attention="auto")).flex_on
    with pytest.raises(ValueError, match="^model.attention = flex: torch .* upgrade torch, or"):
        GPT(dataclasses.replace(SMALL, attention="flex"))


def test_auto_is_flex_on_cuda_without_dropout():
    assert flex.choose("auto", "cuda") == ("sdpa" if flex.unavailable() else "flex")
    assert flex.choose("auto", "cuda", dropout=0.1) == "sdpa"  # FlexAttention has no dropout
    assert flex.choose("auto", "cpu") == "sdpa"
    assert [flex.choose(s, d) for s in ("sdpa", "flex") for d in ("cpu", "cuda")] == \
        ["sdpa", "sdpa", "flex", "flex"]
    assert flex.refusal("cuda", 0.1) == ("model.attention = flex has no attention dropout, and "
                                         "model.dropout = 0.1; use model.attention sdpa (or "
                                         "auto), or model.dropout 0")


def test_a_batch_without_documents_inside_its_rows_is_causal():
    cfg = ARCHS["gpt2"]
    idx = rows(2, 16, 1000)  # no BOS past the first tokens
    assert mask_for(idx, cfg, True, False, 0) is None
    assert mask_for(idx, cfg, True, True, 0) is None  # a KV cache: no documents
    assert mask_for(rows(2, 16, 4), cfg, True, True, 0) is None
    assert mask_for(idx, cfg, True, False, 20) is None  # a band wider than the rows
    assert not torch.is_tensor(mask_for(idx, cfg, True, False, 5))  # the band, as a BlockMask
    assert torch.is_tensor(mask_for(idx, cfg, False, False, 5))


def test_the_weights_do_not_depend_on_it():
    for cfg in ARCHS.values():
        a = GPT(dataclasses.replace(cfg, attention="sdpa"), seed=3).state_dict()
        b = GPT(dataclasses.replace(cfg, attention="flex"), seed=3).state_dict()
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_dropout_under_a_block_mask_is_refused():
    layer = CausalSelfAttention(dataclasses.replace(SMALL, dropout=0.1).resolved()).train()
    with pytest.raises(ValueError, match="^FlexAttention has no attention dropout"):
        layer(torch.zeros(1, 16, 32), mask=flex.block_mask(rows(1, 16, 4), BOS))



# ---- the setting: resolved once, recorded, refused in one line ---------------------------------

@pytest.fixture
def dataset(tmp_path):
    return TokenDataset(write_dataset(tmp_path / "d", np.arange(500) % 50, np.arange(100) % 50,
                                      vocab_size=64, eot_id=7))


def test_preflight_records_what_auto_picks_on_a_cpu(dataset):
    cfg = TrainConfig()
    cfg.model = dataclasses.replace(SMALL, vocab_size=0)
    cfg.data.align = "bos"
    resolved = resolve(cfg, dataset, 1)
    assert cfg.model.attention == "auto" and resolved.model.attention == "sdpa"
    assert resolved.to_dict()["model"]["attention"] == "sdpa"  # config.json's
    assert resolve(resolved, dataset, 1) == resolved
    cfg.model.attention = "sdpa"
    assert resolve(cfg, dataset, 1).model.attention == "sdpa"


def test_flex_with_dropout_is_refused_in_one_line_before_anything_is_written(dataset, tmp_path,
                                                                             capsys):
    run = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--data", str(dataset.path), "--run-dir", str(run), "--device", "cpu",
              "--model.attention", "flex", "--model.dropout", "0.1"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1, err
    if flex.unavailable():
        assert err.startswith("ddpgpt: error: model.attention = flex: torch ")
    else:
        assert err == ("ddpgpt: error: model.attention = flex has no attention dropout, and "
                       "model.dropout = 0.1; use model.attention sdpa (or auto), or "
                       "model.dropout 0\n")
    assert not run.exists()


def test_auto_on_a_cpu_is_flex_for_masked_rows_from_2048_tokens(dataset):
    """Where flex trained a layer faster than the dense mask at every document length measured
    (docs/performance.md); never for unmasked rows (nothing to skip) or with dropout."""
    assert flex.CPU_FLEX_FROM == 2048
    assert [flex.choose("auto", "cpu", 0.0, T, True) for T in (256, 1024, 2047, 2048, 4096)] == \
        ["sdpa"] * 3 + ["flex"] * 2
    assert flex.choose("auto", "cpu", 0.0, 4096, False) == "sdpa"
    assert flex.choose("auto", "cpu", 0.1, 4096, True) == "sdpa"
    cfg = TrainConfig()
    cfg.model = dataclasses.replace(SMALL, vocab_size=0, block_size=2048)
    for align, want in (("bos", "flex"), ("stream", "sdpa")):
        cfg.data.align = align
        assert resolve(cfg, dataset, 1).model.attention == want
    model = GPT(dataclasses.replace(ARCHS["gpt2"], block_size=2048, attention="auto"))
    assert model.flex_on == {"cpu", "cuda"}  # a checkpoint's model, on this device or CUDA


def test_a_config_saved_before_the_setting_reads_as_auto(dataset):
    saved = TrainConfig().to_dict()
    del saved["model"]["attention"]
    old = from_dict(json.loads(json.dumps(saved)))
    assert old.model.attention == "auto"
    assert resolve(old, dataset, 1).model.attention == "sdpa"


def test_a_checkpoint_resumes_with_the_other_attention(tmp_path):
    """A checkpoint of a flex run (as trained on CUDA) is the model of an sdpa run: resumed, not
    refused, and the change is said (changes.changes: logged as a config_change)."""
    trained = TrainConfig(model=dataclasses.replace(SMALL, attention="flex"),
                          data=DataConfig(dir="data"))
    run = RunDir(tmp_path / "run")
    store.save(run.checkpoints, 2, {"model": GPT(SMALL).state_dict()},
               {"config": trained.to_dict(), "world_size": 1, "data_fingerprint": "ab"},
               keep=10)
    for attention in ("sdpa", "auto"):
        cfg = dataclasses.replace(trained, model=dataclasses.replace(SMALL, attention=attention))
        start = resume.choose(cfg, run, True, "ab")
        assert start.step == 2
        assert changes.changes(start.meta["config"], cfg) == {"model.attention": ["flex",
                                                                                 attention]}
    model, found = load_model(run, "cpu")  # eval, sample, export: this device's attention
    assert found.config.model.attention == "flex" and model.cfg.attention == "auto"

def trainer(data, attention: str):
    """A Trainer on rows of documents (data.align bos: the document mask), through `attention`."""
    from ddpgpt.config.io import build
    from ddpgpt.distributed.group import DistEnv
    from ddpgpt.guard.health import Guard, StopSignal
    from ddpgpt.run.preflight import preflight
    from ddpgpt.trainer import Trainer

    flags = {"model": {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 16,
                       "attention": attention},
             "data": {"dir": str(data), "micro_batch": 2, "global_batch": 4, "align": "bos"},
             "run": {"dir": str(data.parent / "run"), "device": "cpu", "threads": 1}}
    cfg, dataset = preflight(build(None, None, flags), 1, 1)
    assert (cfg.model.attention, cfg.model.doc_mask) == (attention, True)
    env = DistEnv()
    return Trainer(cfg, env, dataset, Guard(env, cfg.run, StopSignal(announce=False)))


def test_a_run_resumed_with_the_other_attention_takes_the_same_steps(tmp_path, uncompiled,
                                                                      monkeypatch):
    """An sdpa run resumed after 2 steps with model.attention flex (allowed: the weights are
    the same): the next 2 steps are the straight run's to float rounding, losses and weights.
    (flex -> sdpa: tests/gpu/test_flex.py, on CUDA.)"""
    from ddpgpt.optim.schedule import Rates

    tokens = rows(1, 4000, 6, seed=1)[0].numpy()  # documents of ~6 tokens, several to a row
    data = write_dataset(tmp_path / "d", tokens[:3200], tokens[3200:], vocab_size=64, eot_id=BOS)
    calls = []
    attend = flex.attend
    monkeypatch.setattr(flex, "attend", lambda *a, **k: calls.append(1) or attend(*a, **k))
    straight, resumed, losses = trainer(data, "sdpa"), trainer(data, "flex"), {}
    for step in range(4):
        if step == 2:
            state = copy.deepcopy(straight.state_dict())  # as from disk: nothing shared
            resumed.load_state_dict(state, saved_world_size=1)
        for run in (straight, resumed) if step >= 2 else (straight,):
            loss, _ = run.train_step()
            run.update(Rates(1e-2, 0.95))
            run.step += 1
            losses.setdefault(run, []).append(loss.item())
    assert calls  # flex computed its share of the steps
    np.testing.assert_allclose(losses[resumed], losses[straight][2:], rtol=1e-5, atol=0)
    for a, b in zip(straight.raw.parameters(), resumed.raw.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# ---- sampling and export: unchanged -----------------------------------------------------------

@pytest.mark.parametrize("use_cache", [True, False], ids=["kv-cache", "no-cache"])
def test_sampling_gives_the_same_tokens(uncompiled, monkeypatch, use_cache):
    """Greedy, from a prompt longer than block_size (the sliding band) with document starts
    inside (masked without the cache); tokens equal but where the two best logits tie."""
    cfg = ARCHS["modern"]
    prompt = rows(2, 20, 4, seed=4)
    calls = []
    attend = flex.attend
    monkeypatch.setattr(flex, "attend", lambda *a, **k: calls.append(1) or attend(*a, **k))
    out = {}
    for attention in ("sdpa", "flex"):
        model = perturbed(GPT(dataclasses.replace(cfg, attention=attention), seed=3).eval())
        out[attention] = model.generate(prompt, 6, temperature=0, use_cache=use_cache)
    assert_greedy_agrees(out["flex"], out["sdpa"],  # the no-cache oracle's last logits
                         lambda idx: model(idx[:, -31:], window=16)[0][:, -1])
    assert calls  # the prompt's band (and without the cache its documents) went through flex


@pytest.mark.parametrize("arch", ARCHS)
def test_export_writes_the_same_files(tmp_path, arch):
    pytest.importorskip("transformers")
    from ddpgpt.commands.export import write_model

    cfg = dataclasses.replace(ARCHS[arch], n_head=4, n_kv_head=2 if arch == "modern" else 0)
    weights = GPT(cfg, seed=3).state_dict()
    files = {}
    for attention in ("sdpa", "flex"):
        out = tmp_path / attention
        out.mkdir()
        write_model(out, weights, dataclasses.replace(cfg, attention=attention), 60, BOS, "byte")
        files[attention] = {p.name: p.read_bytes() for p in sorted(out.iterdir())}
    assert files["flex"] == files["sdpa"] and "model.safetensors" in files["flex"]


def test_a_compiled_model_is_one_graph(monkeypatch):
    """Nothing of flex's splits a compiled model's graph (an import in the forward would): the
    band alone, as on CUDA (where no document test waits for the device)."""
    monkeypatch.setattr(flex, "_loaded", None)  # as in a fresh process
    model = GPT(dataclasses.replace(ARCHS["modern"], doc_mask=False, attention="flex")).eval()
    with torch.no_grad():
        explained = torch._dynamo.explain(model)(rows(2, 16, 4), window=8)
    assert explained.graph_break_count == 0, explained.break_reasons

"""The config against a dataset and a run: the batch arithmetic, the dataset-dependent fields and
their resolution, preflight's mode table, a run's config.json as the base of its next start,
--init-from's shapes, choices, and mixtures as data.dir and [[data.sources]]."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from ddpgpt import cli
from ddpgpt.config.checks import ConfigError
from ddpgpt.config.io import build as resolve
from ddpgpt.config.io import continued
from ddpgpt.config.model import ModelConfig
from ddpgpt.config.optim import OptimConfig
from ddpgpt.config.schema import DataConfig, RunConfig, TrainConfig
from ddpgpt.data.shards import TokenDataset
from ddpgpt.errors import UserError
from ddpgpt.run.preflight import accum_steps, preflight
from ddpgpt.run.preflight import resolve as resolve_autos
from ddpgpt.sync.modes import MODES
from tests.helpers import write_dataset
from tests.unit.configs import _error, _parse_train, _toml

# ---- batch arithmetic and the dataset-dependent fields ---------------------------------------

def _batch(G: int, b: int) -> TrainConfig:
    return TrainConfig(data=DataConfig(micro_batch=b, global_batch=G))


@pytest.mark.parametrize("G, b, W, A", [(32, 8, 1, 4), (32, 8, 2, 2), (32, 8, 4, 1), (32, 4, 2, 4),
                                        (48, 2, 3, 8), (8, 8, 1, 1)])
def test_accum_steps(G, b, W, A):
    assert accum_steps(_batch(G, b), W) == A


@pytest.mark.parametrize("G, b, W, fix", [
    (32, 8, 8, "or change the micro-batch"),  # 4 sequences a process: a micro-batch of 4 does
    (32, 8, 3, "or run on a number of processes that divides 32 (1, 2, 4, 8, 16, 32)"),
    (48, 4, 5, "or run on a number of processes that divides 48 (1, 2, 3, 4, 6, 8, 12, 16, 24, "
               "48)")])
def test_accum_steps_indivisible(G, b, W, fix):
    """When W cannot divide G, no micro-batch can help: the line says which W can."""
    assert _error(accum_steps, _batch(G, b), W) == (
        f"data.global_batch = {G} is not divisible by world size {W} × data.micro_batch {b} = "
        f"{W * b}; make the global batch a multiple of {W * b} {fix}")


@pytest.fixture
def dataset(tmp_path):
    """A dataset whose vocabulary (100) is not a multiple of 64."""
    tokens = np.arange(500) % 100
    return TokenDataset(write_dataset(tmp_path / "d", tokens, tokens[:200], vocab_size=100))


def _model(**fields) -> TrainConfig:
    return TrainConfig(model=ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, **fields))


def _resolve(cfg, dataset, local_world_size=1):
    return resolve_autos(cfg, dataset, local_world_size)


def test_resolve_takes_the_datasets_vocab_and_the_block_size(dataset):
    cfg = _resolve(_model(), dataset)
    assert cfg.model.vocab_size == 100  # 128 would add 28% to the output layer
    assert cfg.data.seq_len == 16  # 0 -> block_size
    assert (cfg.model, cfg.data, cfg.optim) == (
        dataclasses.replace(_model().model.resolved(), vocab_size=100,  # the pieces: gpt2
                            doc_mask=False, bos_id=0,  # align stream: no mask; the eot id
                            attention="sdpa"),  # auto on a CPU
        dataclasses.replace(_model().data, seq_len=16, align="stream"),  # auto: no masks
        dataclasses.replace(_model().optim, muon_ns_dtype="fp32"))  # auto: fp32 under fp32


# Rounded up to a multiple of 64 only where that adds at most 1%: 257 bytes stay 257.
@pytest.mark.parametrize("vocab, rounded", [(64, 64), (65, 65), (256, 256), (257, 257),
                                            (1000, 1000), (4000, 4032), (50257, 50304)])
def test_resolve_rounding(tmp_path, vocab, rounded):
    ds = TokenDataset(write_dataset(tmp_path / "d", np.arange(300) % vocab, np.arange(50) % vocab,
                                    vocab))
    assert _resolve(_model(), ds).model.vocab_size == rounded


def test_resolve_keeps_explicit_vocab_and_seq_len(dataset):
    cfg = _model(vocab_size=100)
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, seq_len=8))
    resolved = _resolve(cfg, dataset)
    assert (resolved.model.vocab_size, resolved.data.seq_len) == (100, 8)
    assert _resolve(_model(vocab_size=1000), dataset).model.vocab_size == 1000


def test_resolve_rejects_a_smaller_vocab(dataset):
    assert _error(_resolve, _model(vocab_size=99), dataset) == (
        f"dataset {dataset.path} has a vocabulary of 100 but model.vocab_size = 99; "
        "set model.vocab_size >= 100 (or 0 to follow the dataset)")


def test_resolve_leaves_no_auto_and_is_idempotent(dataset, monkeypatch):
    """Every `auto` (and 0 meaning auto) becomes a value: CPU here, so gloo and fp32; the threads
    are the usable cores shared by the local processes. Resolving again changes nothing: what
    the --nproc launcher writes is what its workers run."""
    import os

    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cores = len(os.sched_getaffinity(0))
    cfg = _resolve(_model(), dataset, local_world_size=2)
    assert (cfg.run.device, cfg.run.backend, cfg.run.precision) == ("cpu", "gloo", "fp32")
    assert cfg.optim.muon_ns_dtype == "fp32"
    assert cfg.run.threads == max(1, cores // 2)
    autos = [f"{sec}.{k}" for sec, fields in cfg.to_dict().items() for k, v in fields.items()
             if v == "auto" or (v == 0 and k in ("vocab_size", "seq_len", "threads"))]
    assert autos == ["run.resume"]  # a policy named auto, not a value left to resolve
    assert _resolve(cfg, dataset, local_world_size=7) == cfg
    # fp16 runs on the CPU too (autocast and GradScaler): its loss scaler is tested there
    assert _resolve(dataclasses.replace(_model(), run=RunConfig(precision="fp16")),
                    dataset).run.precision == "fp16"


def test_resolve_on_cuda(dataset, monkeypatch):
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cfg = _resolve(_model(), dataset)
    assert (cfg.run.device, cfg.run.backend, cfg.run.precision) == ("cuda", "nccl", "bf16")
    cpu = _resolve(dataclasses.replace(_model(), run=RunConfig(device="cpu")), dataset)
    assert (cpu.run.device, cpu.run.backend, cpu.run.precision) == ("cpu", "gloo", "fp32")


@pytest.mark.parametrize("mode", list(MODES))
def test_preflight_refuses_what_the_mode_table_says_a_mode_cannot_do(dataset, mode):
    """Each declaration of sync.MODES that is False is one line naming the setting, why, and the
    modes that can; each that is True resolves. (fp16 is asked for on a cuda device: resolving
    needs no GPU.)"""
    row = MODES[mode]
    asks = {"loss_scaler": ("run.precision = fp16", "use bf16",
                            RunConfig(sync=mode, device="cuda", precision="fp16"), OptimConfig()),
            "compression": ("run.grad_compress = bf16", "use none",
                            RunConfig(sync=mode, device="cpu", grad_compress="bf16"),
                            OptimConfig())}
    for what, (setting, fix, run, optim) in asks.items():
        cfg = dataclasses.replace(_model(), run=run, optim=optim)
        if getattr(row, what):
            assert _resolve(cfg, dataset).run.sync == mode
            continue
        able = ", ".join(m for m, r in MODES.items() if getattr(r, what))
        assert _error(_resolve, cfg, dataset) == (
            f"run.sync = {mode} cannot use {setting}: {row.why_not[what]}; {fix}, or run.sync "
            f"{able}")


def test_an_unknown_sync_mode_is_one_line_naming_the_table(dataset):
    """run.sync is checked against the mode table (sync/modes.py), not a copy of it in the
    config: whatever row the table has is accepted, anything else named in one line."""
    cfg = dataclasses.replace(_model(), run=RunConfig(sync="ring", device="cpu"))
    assert _error(_resolve, cfg, dataset) == (
        f"invalid config: run.sync = 'ring'; choose one of {', '.join(MODES)}")


def test_example_configs_resolve():
    """examples/*.toml load, and their batch divides for the GPU count they are written for."""
    examples = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.toml"))
    assert examples
    for path in examples:
        cfg = resolve(None, str(path), {})
        assert accum_steps(cfg, 8) * 8 * cfg.data.micro_batch == cfg.data.global_batch


def test_print_config_is_the_resolved_config_as_toml_that_config_reads(dataset, tmp_path,
                                                                       capsys):
    """`train --print-config`: every auto resolved for --nproc and the dataset, and the text is a
    --config file that gives back exactly that config."""
    flags = ["--preset", "tiny", "--data", str(dataset.path), "--run-dir", str(tmp_path / "run"),
             "--optim.lr", "3e-3", "--model.block-size", "16", "--data.global-batch", "4",
             "--data.micro-batch", "2"]
    with pytest.raises(SystemExit) as e:
        cli.main(["train", *flags, "--nproc", "2", "--print-config"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith("# resolved for 2 processes, from scratch\n[model]\n")
    (tmp_path / "printed.toml").write_text(text)
    expected, _ = preflight(_parse_train(flags), 2, 2)
    expected = dataclasses.replace(expected, optim=dataclasses.replace(expected.optim,
                                                                       decay_steps=200),
                                   run=dataclasses.replace(expected.run, threads=0))  # a start's
    assert resolve(None, str(tmp_path / "printed.toml"), {}) == expected
    assert not (tmp_path / "run").exists()  # nothing written


# ---- a run's config.json as the base of its next start ------------------------------------------

def test_a_runs_config_continues_with_this_starts_own_settings(dataset):
    """The training's settings come back as they were; the first-start rule and the threads are
    this start's; the device's autos are resolved again when another device is named; the
    schedule's length goes back to auto where it is the run.steps it came from, or where the
    flags start a new schedule."""
    made = _parse_train(["--preset", "tiny", "--data", str(dataset.path), "--run-dir", "r",
                         "--model.block-size", "16", "--data.global-batch", "4",
                         "--data.micro-batch", "2", "--optim.lr", "3e-3", "--reset",
                         "--run.threads", "3"])
    saved, _ = preflight(made, 1, 1)
    saved = dataclasses.replace(saved, optim=dataclasses.replace(saved.optim, decay_steps=200))
    cfg = continued(saved.to_dict(), {}, "config.json")
    assert (cfg.run.resume, cfg.run.threads, cfg.optim.decay_steps) == ("auto", 0, 0)
    assert (cfg.run.device, cfg.run.precision, cfg.run.backend) == ("cpu", "fp32", "gloo")
    assert dataclasses.replace(cfg, run=saved.run, optim=saved.optim) == saved
    assert cfg.optim == dataclasses.replace(saved.optim, decay_steps=0)
    cuda = continued(saved.to_dict(), {"run": {"device": "cuda"}}, "config.json")
    assert saved.model.attention == "sdpa"  # auto on a CPU: resolved again for another device
    assert (cuda.run.precision, cuda.run.backend, cuda.optim.muon_ns_dtype,
            cuda.model.attention) == ("auto",) * 4
    # raised once already (a cosine kept at its first length): the length stays, unless the
    # flags start a new schedule, whose end is its own
    kept = dataclasses.replace(saved, run=dataclasses.replace(saved.run, steps=300))
    assert continued(kept.to_dict(), {}, "config.json").optim.decay_steps == 200
    anew = continued(kept.to_dict(), {"optim": {"schedule_start": "300"}}, "config.json")
    assert anew.optim.decay_steps == 0


def test_train_in_a_run_dir_starts_from_its_config_and_flags_override(dataset, tmp_path):
    """No --preset and no --config: the run dir's config.json, then the flags; with either,
    the layers as always (the command gives the whole config)."""
    run = tmp_path / "run"
    made = _parse_train(["--preset", "tiny", "--data", str(dataset.path), "--run-dir", str(run),
                         "--model.block-size", "16", "--data.seq-len", "8"])
    saved, _ = preflight(made, 1, 1)
    run.mkdir()
    (run / "config.json").write_text(json.dumps(saved.to_dict()))
    cfg = _parse_train(["--run-dir", str(run), "--run.steps", "300"])
    assert cfg.run.steps == 300 and cfg.data == saved.data and cfg.model == saved.model
    again = _parse_train(["--resolved-config", str(run / "config.json"), "--run.steps", "300"])
    assert again == cfg
    assert _parse_train(["--run-dir", str(run), "--preset", "tiny"]).data.dir == "data/stdlib"
    with pytest.raises(UserError) as e:
        _parse_train(["--resolved-config", str(run / "config.json"), "--preset", "tiny"])
    assert str(e.value) == ("--resolved-config is a whole config; --preset does not go with it: "
                            "give one of them (flags override either)")
    (run / "config.json").write_text("{")
    with pytest.raises(UserError) as e:
        _parse_train(["--run-dir", str(run)])
    assert str(e.value).startswith(f"the run's config {run / 'config.json'}: not valid JSON (")
    assert str(e.value).endswith("; restore it, or give the whole config (--preset, --config)")


# ---- --init-from: the weights' shape before the sequence length is checked -----------------------

def test_gpt2s_sequence_length_is_checked_against_its_weights_not_the_default():
    """README's fine-tune: `--init-from gpt2 --data.seq-len 512` (GPT-2's 1024 positions; the
    default block_size is 256). The hub's shapes are known without the network."""
    cfg = _parse_train(["--data", "d", "--init-from", "gpt2", "--data.seq-len", "512",
                        "--optim.lr", "1e-4", "--run-dir", "runs/ft"])
    assert (cfg.model.block_size, cfg.data.seq_len, cfg.model.n_layer) == (1024, 512, 12)
    with pytest.raises(ConfigError, match="data.seq_len = 2048 exceeds model.block_size = 1024"):
        _parse_train(["--data", "d", "--init-from", "gpt2", "--data.seq-len", "2048"])


def test_a_local_gpt2_directorys_positions_bound_the_sequence_length(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=512,
                                     vocab_size=300)
    transformers.GPT2LMHeadModel(config).save_pretrained(str(tmp_path / "small"))
    cfg = _parse_train(["--data", "d", "--init-from", str(tmp_path / "small"),
                        "--data.seq-len", "300"])
    assert (cfg.model.block_size, cfg.data.seq_len, cfg.model.n_embd) == (512, 300, 32)
    with pytest.raises(ConfigError, match="data.seq_len = 600 exceeds model.block_size = 512"):
        _parse_train(["--data", "d", "--init-from", str(tmp_path / "small"),
                      "--data.seq-len", "600"])


def _choice_fields():
    """(section, config class, field, its choices) for every setting typed as a Literal."""
    import typing

    from ddpgpt.config import commands
    from ddpgpt.config.io import field_types
    from ddpgpt.config.schema import SECTIONS

    classes = [(s, c) for s, c in SECTIONS.items()] + [
        (c.__name__.removesuffix("Config").lower(), c) for c in vars(commands).values()
        if dataclasses.is_dataclass(c) and c.__module__ == commands.__name__]
    return [(section, cls, name, typing.get_args(tp)) for section, cls in classes
            for name, tp in field_types(cls).items() if typing.get_origin(tp) is typing.Literal]


@pytest.mark.parametrize("section, cls, name, choices", _choice_fields(),
                         ids=lambda v: v if isinstance(v, str) else "")
def test_a_choice_is_checked_against_its_literal_and_nothing_else(section, cls, name, choices):
    """Every value of the field's Literal is accepted; one outside it is refused with the
    Literal's list: validation reads the type, no copied list."""
    for value in choices:
        assert getattr(cls(**{name: value}), name) == value
    with pytest.raises(ConfigError) as e:
        cls(**{name: "zzzzzzzz"})
    assert str(e.value).endswith(f"{section}.{name} = 'zzzzzzzz'; choose one of "
                                 f"{', '.join(choices)}")


# ---- mixtures: data.dir DIR:WEIGHT,... and [[data.sources]] -----------------------------------

def test_a_mixture_in_toml_is_data_dir_as_the_flag_writes_it(tmp_path):
    path = _toml(tmp_path, '[[data.sources]]\ndir = "data/a"\nweight = 7\n\n'
                           '[[data.sources]]\ndir = "data/b"\nweight = 3\n')
    cfg = resolve(None, path, {})
    assert cfg.data.dir == "data/a:7,data/b:3"
    assert cfg.data.sources() == [("data/a", 0.7), ("data/b", 0.3)]
    assert resolve(None, None, {"data": {"dir": "data/a:7,data/b:3"}}).data == cfg.data


@pytest.mark.parametrize("text, message", [
    ('[data]\ndir = "x"\n[[data.sources]]\ndir = "a"\n',
     "data.dir and [[data.sources]] both name the data; keep one"),
    ('[[data.sources]]\npath = "a"\n',
     "data.sources[0] = {'path': 'a'}; write [[data.sources]] tables, each with dir = \"DIR\" "
     "and weight = NUMBER"),
    ('[[data.sources]]\ndir = "a"\nweight = "0.5"\n',
     "data.sources[0] = {'dir': 'a', 'weight': '0.5'}; write [[data.sources]] tables, each "
     "with dir = \"DIR\" and weight = NUMBER"),
])
def test_bad_sources_tables(tmp_path, text, message):
    path = _toml(tmp_path, text)
    assert _error(resolve, None, path, {}) == f"{path}: {message}"


@pytest.mark.parametrize("spec, message", [
    ("a:0.7,b", "give every dataset of the mixture a weight (a:0.7,b:0.3), or none for equal "
                "shares"),
    ("a:0.7,b:-1", "the weight of b must be a number > 0, got '-1'; write DIR:WEIGHT,DIR:WEIGHT "
                   "(a:0.7,b:0.3)"),
    ("a:1,a:2", "a is listed twice; give each dataset once, with its whole weight"),
    ("a:1e308,b:1e308", "the weights add up to more than a float holds (every share would be "
                        "0); give weights of a sensible size (a:0.7,b:0.3)"),
    ("a:1e-300,b:1e300", "the weight of a is 0 beside the others' sum (too small for a float); "
                         "give weights of a sensible size (a:0.7,b:0.3)"),
])
def test_bad_mixtures_are_one_line(spec, message):
    with pytest.raises(ConfigError) as e:
        resolve(None, None, {"data": {"dir": spec}})
    assert str(e.value) == f"invalid config: data.dir = {spec!r}: {message}"


def test_a_mixture_without_weights_takes_equal_shares():
    assert resolve(None, None, {"data": {"dir": "a,b,c"}}).data.sources() == \
        [("a", 1 / 3), ("b", 1 / 3), ("c", 1 / 3)]


def test_one_dataset_with_a_weight_is_that_dataset():
    from ddpgpt.config.schema import DataConfig

    assert DataConfig(dir="data/a:1").sources() == [("data/a", 1.0)]
    assert DataConfig(dir="data/a:b").sources() == [("data/a:b", 1.0)]

"""Config resolution (preset -> TOML -> flags), every error message word for word, the config.json
round trip (the config against a dataset and a run: test_config_resolve.py)."""

from __future__ import annotations

import dataclasses
import json
import sys

import pytest

from ddpgpt import cli
from ddpgpt.config import presets
from ddpgpt.config.io import build as resolve
from ddpgpt.config.io import from_dict, nest, to_toml
from ddpgpt.config.model import ModelConfig
from ddpgpt.config.optim import OptimConfig
from ddpgpt.config.schema import DataConfig, RunConfig, TrainConfig
from ddpgpt.errors import UserError
from tests.processes import run_cli
from tests.unit.configs import _error, _parse_train, _toml

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

MODEL_KEYS = ("n_layer, n_head, n_embd, block_size, vocab_size, arch, rope, norm, qk_norm, mlp, "
              "mlp_hidden, bias, tie_embeddings, zero_init_proj, logit_softcap, n_kv_head, "
              "head_dim, rope_theta, norm_eps, doc_mask, bos_id, attention, kernels, dropout, "
              "gelu, vocab_limit, init_from")


@pytest.mark.parametrize("argv, bias, compile_", [
    (["--model.bias", "false"], False, False),
    (["--model.bias=False", "--compile", "yes"], False, True),
    (["--no-model.bias", "--run.compile", "1"], False, True),
    (["--model.bias", "--compile"], True, True),
])
def test_boolean_flags_take_true_or_false_too(argv, bias, compile_):
    """`--model.bias false` reads like the TOML `bias = false`: it used to fail with
    "unrecognized arguments: false", naming neither the flag nor --no-model.bias."""
    parser = cli._build_parser()
    ns = parser.parse_args(cli.bool_values(parser, ["train", *argv]))
    cfg = cli.train_config({k: v for k, v in vars(ns).items() if k not in ("command", "debug")})[0]
    assert (cfg.model.bias, cfg.run.compile) == (bias, compile_)
    with pytest.raises(UserError) as e:
        cli.bool_values(parser, ["train", "--model.bias=maybe"])
    assert str(e.value) == ("--model.bias: expected true or false, got 'maybe' (or write "
                            "--model.bias / --no-model.bias)")


# ---- layering --------------------------------------------------------------------------------

def test_no_layers_gives_the_defaults():
    assert resolve(None, None, {}) == TrainConfig()


def test_preset_then_file_then_flags(tmp_path):
    path = _toml(tmp_path, 'preset = "tiny"\n[model]\nn_layer = 2\nn_embd = 128\n'
                           '[optim]\nlr = 1e-3\n[run]\nsteps = 50\n')
    cfg = resolve(None, path, {"model": {"n_embd": "64"}, "run": {"seed": "7"}})
    tiny = presets.tiny()
    expected = dataclasses.replace(
        tiny,
        model=dataclasses.replace(tiny.model, n_layer=2, n_embd=64),  # file, then the flag wins
        optim=dataclasses.replace(tiny.optim, lr=1e-3),
        run=dataclasses.replace(tiny.run, steps=50, seed=7),
    )
    assert cfg == expected


def test_file_preset_loses_to_explicit_preset(tmp_path):
    path = _toml(tmp_path, 'preset = "small"\n[run]\nsteps = 9\n')
    cfg = resolve("tiny", path, {})
    assert cfg.model == presets.tiny().model
    assert cfg.run.steps == 9


def test_command_line_parser_path(tmp_path):
    path = _toml(tmp_path, "[data]\nmicro_batch = 4\nglobal_batch = 8\n[optim]\nwarmup_steps = 5\n")
    cfg = _parse_train(["--data", "d", "--preset", "tiny", "--config", path,
                        "--optim.warmup-steps", "7", "--model.n_layer", "3", "--no-model.bias",
                        "--run-dir", "r", "--compile"])
    tiny = presets.tiny()
    assert cfg == dataclasses.replace(
        tiny,
        model=dataclasses.replace(tiny.model, n_layer=3, bias=False),
        data=dataclasses.replace(tiny.data, dir="d", micro_batch=4, global_batch=8),
        optim=dataclasses.replace(tiny.optim, warmup_steps=7),
        run=dataclasses.replace(tiny.run, dir="r", compile=True),
    )


def test_nest_sections_and_drop_the_rest():
    values = {"optim.lr": "3e-4", "model.n_layer": "2", "data.dir": "d", "preset": "tiny",
              "nproc": 2}
    assert nest(values) == {"optim": {"lr": "3e-4"}, "model": {"n_layer": "2"},
                            "data": {"dir": "d"}}


def test_int_in_toml_is_accepted_for_a_float(tmp_path):
    cfg = resolve(None, _toml(tmp_path, "[optim]\nlr = 1\nmin_lr = 0\n"), {})
    assert cfg.optim.lr == 1.0 and type(cfg.optim.lr) is float
    assert cfg.optim.min_lr == 0.0 and type(cfg.optim.min_lr) is float


# ---- messages: unknown keys and types --------------------------------------------------------

def test_unknown_key_in_toml(tmp_path):
    path = _toml(tmp_path, "[model]\nn_layers = 2\n")
    assert _error(resolve, None, path, {}) == (f"{path}: unknown key model.n_layers; known: "
                                               f"{MODEL_KEYS}")


def test_unknown_section_in_toml(tmp_path):
    path = _toml(tmp_path, "[training]\nsteps = 2\n")
    assert _error(resolve, None, path, {}) == (f"{path}: unknown section [training]; known: "
                                               "model, data, optim, run")


def test_section_that_is_not_a_table(tmp_path):
    path = _toml(tmp_path, "model = 3\n")
    assert _error(resolve, None, path, {}) == f"{path}: [model] must be a table of fields, got 3"


@pytest.mark.parametrize("text, message", [
    ('[model]\nn_layer = "two"\n', "model.n_layer: expected an integer, got 'two' (str)"),
    ("[model]\nn_layer = true\n", "model.n_layer: expected an integer, got True (bool)"),
    ("[model]\nn_layer = 2.0\n", "model.n_layer: expected an integer, got 2.0 (float)"),
    ("[optim]\nlr = false\n", "optim.lr: expected a number, got False (bool)"),
    ("[model]\nbias = 1\n", "model.bias: expected true or false, got 1 (int)"),
    ("[data]\ndir = 5\n", "data.dir: expected a string, got 5 (int)"),
])
def test_wrong_type_in_toml(tmp_path, text, message):
    path = _toml(tmp_path, text)
    assert _error(resolve, None, path, {}) == f"{path}: {message}"


@pytest.mark.parametrize("text, message", [
    ('[model]\nn_layer = "4"\n', "model.n_layer: expected an integer, got '4' (str)"),
    ('[optim]\nlr = "3e-4"\n', "optim.lr: expected a number, got '3e-4' (str)"),
    ('[model]\nbias = "yes"\n', "model.bias: expected true or false, got 'yes' (str)"),
], ids=["int", "float", "bool"])
def test_quoted_value_in_toml_is_a_type_error(tmp_path, text, message):
    path = _toml(tmp_path, text)
    assert _error(resolve, None, path, {}) == f"{path}: {message}"


@pytest.mark.parametrize("argv, message", [
    (["--optim.lr", "abc"], "command line: optim.lr: expected a number, got 'abc'"),
    (["--model.n-layer", "2.5"], "command line: model.n_layer: expected an integer, got '2.5'"),
    (["--run.steps", "1e3"], "command line: run.steps: expected an integer, got '1e3'"),
])
def test_wrong_type_on_the_command_line(argv, message):
    assert _error(_parse_train, ["--data", "d", *argv]) == message


def test_unknown_flag_is_a_one_line_user_error():
    from ddpgpt.errors import UserError
    with pytest.raises(UserError) as e:
        _parse_train(["--data", "d", "--model.n-layers", "2"])
    assert str(e.value) == ("unrecognized arguments: --model.n-layers 2 (did you mean "
                            "--model.n-layer?)")


# ---- messages: ranges, presets, files --------------------------------------------------------

@pytest.mark.parametrize("build, message", [
    (lambda: ModelConfig(n_layer=0), "model.n_layer = 0 must be >= 1"),
    (lambda: ModelConfig(n_head=3, n_embd=64), "model.n_head = 3 must divide model.n_embd = 64"),
    (lambda: ModelConfig(vocab_size=-1),
     "model.vocab_size = -1 must be >= 0 (0: from the dataset)"),
    (lambda: ModelConfig(dropout=1.0), "model.dropout = 1.0 must be in [0, 1)"),
    (lambda: OptimConfig(lr=1e-3, min_lr=2e-3),
     "optim.min_lr = 0.002 is above optim.lr = 0.001; give --optim.min-lr 0.0001 (a tenth of "
     "optim.lr, what it is unset) or another value in [0, 0.001]"),
    (lambda: OptimConfig(min_lr=-1e-5), "optim.min_lr = -1e-05 must be >= 0"),
    (lambda: OptimConfig(schedule_start=-1), "optim.schedule_start = -1 must be >= 0"),
    (lambda: OptimConfig(lr=0.0), "optim.lr = 0.0 must be > 0"),
    (lambda: OptimConfig(beta2=1.0), "optim.beta2 = 1.0 must be in [0, 1)"),
    (lambda: DataConfig(micro_batch=0), "data.micro_batch = 0 must be >= 1"),
    (lambda: TrainConfig(model=ModelConfig(block_size=64), data=DataConfig(seq_len=128)),
     "data.seq_len = 128 exceeds model.block_size = 64; set data.seq_len <= 64 "
     "(0: model.block_size) or raise model.block_size"),
    (lambda: TrainConfig(data=DataConfig(micro_batch=8, global_batch=20)),
     "data.global_batch = 20 is not a multiple of data.micro_batch = 8"),
    (lambda: RunConfig(precision="fp8"),
     "run.precision = 'fp8'; choose one of auto, fp32, bf16, fp16"),
    (lambda: RunConfig(steps=0), "run.steps = 0 must be >= 1"),
    (lambda: RunConfig(lease_stale_s=-1), "run.lease_stale_s = -1 must be > 0"),
])
def test_out_of_range(build, message):
    assert _error(build) == f"invalid config: {message}"


def test_out_of_range_through_the_layers(tmp_path):
    path = _toml(tmp_path, "[model]\nn_embd = 64\n")
    assert _error(resolve, None, path, {"model": {"n_head": "3"}}) == \
        "invalid config: model.n_head = 3 must divide model.n_embd = 64"
    # an old run's config.json holds its min_lr: a lower lr is refused, naming the flag
    saved = from_dict({"optim": {"lr": 1e-3, "min_lr": 1e-4}})
    assert _error(lambda: resolve(None, None, {"optim": {"lr": "1e-5"}}, base=saved)) == (
        "invalid config: optim.min_lr = 0.0001 is above optim.lr = 1e-05; give --optim.min-lr "
        "1e-06 (a tenth of optim.lr, what it is unset) or another value in [0, 1e-05]")


def test_min_lr_unset_follows_the_lr_and_a_saved_one_keeps_its_value(tmp_path):
    """README's fine-tune at --optim.lr 1e-4, or 1e-5, with a preset: the floor is a tenth of the
    lr given, not the preset's; a config.json that holds a number (every run before min_lr could
    be unset, or one that set it) keeps it, whatever lr a flag gives."""
    for lr in ("1e-4", "1e-5"):
        cfg = resolve("tiny", None, {"optim": {"lr": lr}})
        assert (cfg.optim.min_lr, cfg.optim.floor) == (None, float(lr) / 10)
    assert presets.get_preset("gpt2-124m").optim.floor == 6e-4 / 10
    saved = from_dict({"optim": {"lr": 1e-3, "min_lr": 1e-4}})
    assert resolve(None, None, {"optim": {"lr": "2e-3"}}, base=saved).optim.floor == 1e-4
    new = from_dict(json.loads(json.dumps(resolve("tiny", None, {}).to_dict())))
    assert resolve(None, None, {"optim": {"lr": "1e-3"}}, base=new).optim.floor == 1e-4
    assert "min_lr" not in to_toml(new) and resolve(None, _toml(tmp_path, to_toml(new)), {}) == new


def test_out_of_range_in_toml_names_the_file(tmp_path):
    path = _toml(tmp_path, "[model]\nn_layer = 0\n")
    message = _error(resolve, None, path, {})
    assert message == f"{path}: invalid config: model.n_layer = 0 must be >= 1"


def test_unknown_preset(tmp_path):
    expected = "unknown preset 'huge'; choose one of tiny, speedrun, small, gpt2-124m, gpt2-350m"
    assert _error(resolve, "huge", None, {}) == expected
    assert _error(resolve, None, _toml(tmp_path, 'preset = "huge"\n'), {}) == expected


def test_invalid_toml(tmp_path):
    text = "[model\nn_layer = 2\n"
    with pytest.raises(tomllib.TOMLDecodeError) as parse_error:
        tomllib.loads(text)
    path = _toml(tmp_path, text)
    assert _error(resolve, None, path, {}) == f"{path}: not valid TOML ({parse_error.value})"


def test_missing_config_file(tmp_path):
    path = str(tmp_path / "nope.toml")
    assert _error(resolve, None, path, {}) == f"config file {path} not found"


# ---- the real command line: exit 2, one line, nothing written ---------------------------------

@pytest.mark.parametrize("extra, message", [
    (["--bogus", "1"], "unrecognized arguments: --bogus 1 (see --help)"),
    (["--optim.lr", "abc"], "command line: optim.lr: expected a number, got 'abc'"),
    (["--config", "bad.toml"], f"bad.toml: unknown key model.n_layers; known: {MODEL_KEYS}"),
], ids=["unknown-flag", "bad-value", "unknown-toml-key"])
def test_cli_rejects_bad_input_in_one_line(tmp_path, extra, message):
    (tmp_path / "bad.toml").write_text("[model]\nn_layers = 2\n")
    result = run_cli("train", "--data", "data", "--run-dir", "run", *extra, cwd=tmp_path)
    assert (result.returncode, result.stderr, result.stdout) == (
        2, f"ddpgpt: error: {message}\n", "")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.toml"]


# ---- config.json round trip -----------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(presets.PRESETS))
def test_to_dict_from_dict_round_trip(name):
    cfg = presets.get_preset(name)
    assert from_dict(cfg.to_dict()) == cfg


def test_round_trip_through_json_of_a_non_default_config():
    cfg = TrainConfig(model=ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=16,
                                        vocab_size=64, bias=False),
                      data=DataConfig(dir="x", seq_len=16, micro_batch=2, global_batch=6,
                                      shuffle=False),
                      optim=OptimConfig(lr=3.0, min_lr=0.5, warmup_steps=0),
                      run=RunConfig(dir="r", precision="bf16", bucket_mb=1.5, compile=True))
    back = from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert back == cfg
    assert type(back.optim.lr) is float

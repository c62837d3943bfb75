"""A mistake that is a near miss gets its answer: the flag, preset, choice, sync mode, dataset or
run the user meant, in the one line of the error."""

import numpy as np
import pytest

from ddpgpt.cli import _build_parser, main
from ddpgpt.errors import UserError
from tests.helpers import write_dataset


def _parse_error(argv: list[str]) -> str:
    with pytest.raises(UserError) as e:
        _build_parser().parse_args(argv)
    return str(e.value)


@pytest.mark.parametrize("argv, meant", [
    (["train", "--optim.weight_decy", "0.1"], "--optim.weight-decay"),
    (["train", "--optim.weight-decy=0.1"], "--optim.weight-decay"),
    (["train", "--optim.learning-rate", "1e-3"], "--optim.lr"),   # other trainers' names
    (["train", "--max-iters", "5"], "--run.steps"),
    (["train", "--batch-size", "8"], "--data.global-batch"),
    (["train", "--data.seqlen", "4"], "--data.seq-len"),
    (["sample", "--temprature", "0"], "--temperature"),
    (["prepare", "--tokeniser=byte"], "--tokenizer"),
    (["train", "--lr", "3e-4"], "--optim.lr"),                    # ours without its section
    (["train", "--seed", "3"], "--data.seed or --run.seed"),
    (["train", "--run.lr", "3e-4"], "--optim.lr"),                # ... or in another one
])
def test_a_mistyped_flag_names_the_flag_meant(argv, meant):
    typed = " ".join(argv[1:])
    assert _parse_error(argv) == (f"unrecognized arguments: {typed} (did you mean {meant}?)")


def test_a_flag_like_no_other_gets_no_guess():
    assert _parse_error(["train", "--bogus", "1"]) == ("unrecognized arguments: --bogus 1 "
                                                       "(see --help)")


@pytest.mark.parametrize("argv, line", [
    (["train", "--data", "d", "--preset", "tinny"],
     "unknown preset 'tinny' (did you mean tiny?); choose one of tiny, speedrun, small, "
     "gpt2-124m, gpt2-350m"),
    (["train", "--data", "d", "--preset", "tyni"],  # letters swapped: difflib's ratio 0.5
     "unknown preset 'tyni' (did you mean tiny?); choose one of tiny, speedrun, small, "
     "gpt2-124m, gpt2-350m"),
    (["train", "--data", "d", "--run.precision", "bf61"],
     "invalid config: run.precision = 'bf61' (did you mean bf16?); choose one of auto, fp32, "
     "bf16, fp16"),
    (["prepare", "--tokenizer", "gtp2", "--out", "x"],
     "invalid config: prepare.tokenizer = 'gtp2' (did you mean gpt2?); choose one of bpe, "
     "byte, gpt2"),
])
def test_a_mistyped_choice_names_the_choice_meant(argv, line, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit):
        main(argv)
    assert capsys.readouterr().err == f"ddpgpt: error: {line}\n"


def test_a_mistyped_sync_mode_names_the_mode_meant():
    from ddpgpt.sync.modes import check
    with pytest.raises(UserError) as e:
        check("zero")
    assert str(e.value) == ("invalid config: run.sync = 'zero' (did you mean zero1?); choose one "
                            "of ddp, allreduce, rs-ag, zero1, fsdp2")


def test_a_mistyped_dataset_or_run_names_what_exists_beside_it(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    tokens = np.arange(64, dtype=np.uint16) % 7
    write_dataset(tmp_path / "data" / "stdlib", tokens, tokens, vocab_size=7)
    (tmp_path / "runs" / "demo" / "checkpoints").mkdir(parents=True)
    lines = []
    for argv in (["train", "--data", "data/stdlb"], ["train", "--data", "data/mine"],
                 ["eval", "--run-dir", "runs/dmeo"]):
        with pytest.raises(SystemExit):
            main(argv)
        lines.append(capsys.readouterr().err)
    assert lines == [
        "ddpgpt: error: dataset data/stdlb does not exist (did you mean data/stdlib?); create "
        "it with: ddpgpt prepare --out data/stdlb\n",
        "ddpgpt: error: dataset data/mine does not exist (prepared beside it: data/stdlib); "
        "create it with: ddpgpt prepare --out data/mine\n",
        "ddpgpt: error: run runs/dmeo has no complete checkpoint (did you mean runs/demo?); "
        "train first (ddpgpt train --run-dir runs/dmeo)\n"]


def test_a_mistyped_command_names_the_command_meant(capsys):
    with pytest.raises(SystemExit) as e:
        main(["trian", "--data", "d"])
    assert e.value.code == 2
    assert capsys.readouterr().err == (
        "ddpgpt: error: unknown command 'trian' (did you mean train?); the commands: prepare, "
        "train, sample, eval, doctor, bench, plot, chat, export, check, rendezvous "
        "(ddpgpt --help)\n")


def test_a_mistyped_run_to_continue_names_the_run_meant(tmp_path, monkeypatch, capsys):
    """`train --run-dir R` without --data continues R: a name that holds no run is refused,
    with the run meant, instead of training a new run from the defaults into it."""
    monkeypatch.chdir(tmp_path)
    tokens = np.arange(64, dtype=np.uint16) % 7
    write_dataset(tmp_path / "data" / "stdlib", tokens, tokens, vocab_size=7)  # the default
    (tmp_path / "runs" / "mix").mkdir(parents=True)
    (tmp_path / "runs" / "mix" / "config.json").write_text("{}")
    (tmp_path / "runs" / "empty").mkdir()
    lines = []
    for argv in (["train", "--run-dir", "runs/mxi", "--run.steps", "60"],
                 ["train", "--run-dir", "runs/empty"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
        lines.append(capsys.readouterr().err)
    fix = ("to continue a run, give its --run-dir; to start a new one there, give its --data "
           "(and a --preset)\n")
    assert lines == [
        f"ddpgpt: error: run dir runs/mxi does not exist (did you mean runs/mix?); {fix}",
        f"ddpgpt: error: run dir runs/empty holds no run (no config.json) (runs beside it: "
        f"runs/mix); {fix}"]
    assert not (tmp_path / "runs" / "mxi").exists()

"""Where a run starts (resume.choose): each rule of run.resume, on the first start and on a
restart, against checkpoints written by the real store."""

from __future__ import annotations

import dataclasses
import json

import pytest

from ddpgpt.checkpoint import store
from ddpgpt.config.optim import OptimConfig
from ddpgpt.config.schema import DataConfig, RunConfig, TrainConfig
from ddpgpt.errors import UserError
from ddpgpt.model.gpt import GPT
from ddpgpt.run import changes, resume
from ddpgpt.run.run_dir import RunDir
from tests.conftest import STDLIB
from tests.helpers import SMALL

FP = "ab" * 32  # the dataset fingerprint these runs train on


def config(resume_mode: str = "auto", allow_switch: bool = False) -> TrainConfig:
    return TrainConfig(model=SMALL, data=DataConfig(dir="data", allow_switch=allow_switch),
                       run=RunConfig(resume=resume_mode))


def save(run: RunDir, step: int, origin: dict | None = None, fingerprint: str = FP,
         tokenizer: str | None = None, rollbacks: int = 0):
    meta = {"config": config().to_dict(), "world_size": 1, "data_fingerprint": fingerprint,
            "origin": origin, "rollbacks": rollbacks,
            **({"tokenizer_fingerprint": tokenizer} if tokenizer else {})}
    return store.save(run.checkpoints, step, {"model": GPT(SMALL).state_dict()}, meta,
                      keep=100)


def choose(run: RunDir, mode: str = "auto", first: bool = True, tokenizer: str | None = None,
           **kw) -> resume.Start:
    return resume.choose(config(mode, **kw), run, first, FP, tokenizer=tokenizer)


@pytest.fixture
def run(tmp_path) -> RunDir:
    return RunDir(tmp_path / "run")


@pytest.fixture
def other(tmp_path) -> RunDir:
    """Another run's dir, whose step 4 is resumed explicitly."""
    other = RunDir(tmp_path / "other")
    save(other, 4)
    return other


def test_auto(run):
    assert choose(run).path is None
    save(run, 2)
    save(run, 4)
    assert choose(run).path.name == "step_0000004"


def test_explicit_path_then_its_continuation(run, other):
    path = other.checkpoints / "step_0000004"
    start = choose(run, str(path))
    assert (start.path, start.origin) == (path, {"path": str(path.resolve()), "step": 4})
    save(run, 6, origin=start.origin)  # the run goes on from PATH...
    save(run, 8, origin=start.origin)
    for first in (True, False):  # ...so a rerun (first start) or a restart continues from
                                 # the run dir
        assert choose(run, str(path), first=first).path.name == "step_0000008"


def test_explicit_path_into_another_runs_dir_is_refused(run, other):
    save(run, 10)
    path = other.checkpoints / "step_0000004"
    with pytest.raises(UserError) as e:
        choose(run, str(path))
    assert str(e.value) == (f"--resume {path}: run dir {run} already has checkpoints of another "
                            "run (up to step 10); resume into an empty --run-dir")


def test_explicit_path_inside_the_run_dir_rolls_back_once(run):
    for step in (2, 4, 6):
        save(run, step)
    path = run.checkpoints / "step_0000002"
    start = choose(run, str(path))
    assert start.path == path and start.set_aside == [run.checkpoints / "step_0000004",
                                                      run.checkpoints / "step_0000006"]
    # a restart never sets anything aside
    assert choose(run, str(path), first=False).set_aside == []


def test_explicit_path_that_is_not_there(run, tmp_path):
    with pytest.raises(UserError) as e:
        choose(run, str(tmp_path / "nope"))
    assert str(e.value) == (f"--resume {tmp_path / 'nope'}: no such checkpoint directory; give a "
                            "step_NNNNNNN directory of a run's checkpoints/, or --resume auto")


def test_never_and_reset_are_first_start_rules(run):
    save(run, 4)
    with pytest.raises(UserError,
                       match=r"already has checkpoints \(up to step 4\) and run.resume = never"):
        choose(run, "never")
    assert choose(run, "never", first=False).path.name == "step_0000004"
    assert choose(run, "reset").path is None  # the caller sets the checkpoints aside
    assert choose(run, "reset", first=False).path.name == "step_0000004"


def test_another_dataset_is_refused_unless_allowed(run):
    save(run, 4, fingerprint="cd" * 32)
    with pytest.raises(UserError) as e:
        choose(run)
    assert str(e.value) == (f"run dir {run}: checkpoint step_0000004 was trained on another "
                            f"dataset (data, fingerprint {'cd' * 6}) than data.dir = data "
                            f"(fingerprint {'ab' * 6}); pass its --data, --reset to start over, "
                            "or --data.allow-switch to go on with the new data")
    assert choose(run, allow_switch=True).data_switch


def two_bpe_tokenizers(tmp_path):
    """Two real bpe tokenizers of the same vocabulary size, trained on different text."""
    from ddpgpt.data.tokenizer import BPETokenizer

    dirs = []
    for name, source in (("a", "textwrap.py"), ("b", "heapq.py")):
        tok = BPETokenizer.train([(STDLIB / source).read_text()], vocab_size=300,
                                 show_progress=False)
        (tmp_path / name).mkdir()
        tok.save(tmp_path / name)
        assert tok.vocab_size == 300
        dirs.append(tmp_path / name)
    return dirs


def test_another_tokenizer_is_refused_even_with_allow_switch(run, tmp_path):
    """allow_switch is for new data under the same tokenizer: a bpe of the same vocabulary size
    trained on other text maps ids to other text, and training on would start from noise."""
    from ddpgpt.data.tokenizer import fingerprint

    a, b = (fingerprint("bpe", d) for d in two_bpe_tokenizers(tmp_path))
    assert a != b and a.startswith("bpe:")
    save(run, 4, fingerprint="cd" * 32, tokenizer=a)
    with pytest.raises(UserError) as e:
        choose(run, allow_switch=True, tokenizer=b)
    assert str(e.value) == (
        f"run dir {run}: checkpoint step_0000004 was trained with another tokenizer (bpe "
        f"{a[4:16]}) than the one of data.dir = data (bpe {b[4:16]}): its ids would mean other "
        "text. --data.allow-switch is for new data under the same tokenizer: prepare the new data "
        f"with the run's tokenizer (ddpgpt prepare SOURCES --tokenizer-from {run} --out DIR), or "
        "start a new run")
    assert choose(run, allow_switch=True, tokenizer=a).data_switch  # same tokenizer: new data


def test_another_tokenizers_data_dir_is_answered_with_the_runs_own(run, tmp_path):
    """A run continued with the default data dir (a command that left out its --data) is told
    its own data first, not to prepare new data with its tokenizer."""
    from ddpgpt.data.tokenizer import fingerprint

    a, b = (fingerprint("bpe", d) for d in two_bpe_tokenizers(tmp_path))
    save(run, 4, fingerprint="cd" * 32, tokenizer=a)
    cfg = config()
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, dir="data/stdlib"))
    with pytest.raises(UserError) as e:
        resume.choose(cfg, run, True, FP, tokenizer=b)
    assert (f"its ids would mean other text. To continue it on its own data, pass --data data "
            f"(train --run-dir {run} alone takes the run's settings). --data.allow-switch is "
            "for new data") in str(e.value)


def test_a_checkpoint_without_a_recorded_tokenizer_is_checked_from_its_run_dir(run, tmp_path):
    """Checkpoints written before the tokenizer was recorded: the run dir's copy of the
    tokenizer (data_meta.json, tokenizer.json) names it."""
    from ddpgpt.data.tokenizer import fingerprint

    first, second = two_bpe_tokenizers(tmp_path)
    save(run, 4, fingerprint="cd" * 32)
    (run.path / "data_meta.json").write_text('{"tokenizer": "bpe"}')
    (run.path / "tokenizer.json").write_bytes((first / "tokenizer.json").read_bytes())
    with pytest.raises(UserError, match="trained with another tokenizer"):
        choose(run, allow_switch=True, tokenizer=fingerprint("bpe", second))
    assert choose(run, allow_switch=True, tokenizer=fingerprint("bpe", first)).data_switch


def test_explicit_path_of_another_shape(run, other):
    path = other.checkpoints / "step_0000004"
    cfg = config(str(path))
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, n_embd=64))
    with pytest.raises(UserError) as e:
        resume.choose(cfg, run, True, FP)
    assert str(e.value) == (f"--resume {path}: refused: that checkpoint has another model shape "
                            "or optimizer (n_embd 32 -> 64); resume it with the settings in its "
                            "meta.json")


def test_another_architecture_is_refused_and_a_checkpoint_before_the_pieces_is_gpt2(run):
    """A checkpoint whose config predates the architecture's pieces is model.arch gpt2: it
    resumes as gpt2 and is refused as modern, naming the pieces; the widths that follow from the
    pieces are named only when nothing else differs."""
    saved = save(run, 2)
    meta = saved / "meta.json"
    old = json.loads(meta.read_text())
    for key in ("arch", "rope", "norm", "qk_norm", "mlp", "mlp_hidden", "tie_embeddings",
                "zero_init_proj", "logit_softcap", "n_kv_head", "head_dim", "rope_theta",
                "norm_eps"):
        del old["config"]["model"][key]
    meta.write_text(json.dumps(old))
    assert choose(run).path.name == "step_0000002"
    modern = dataclasses.replace(config(), model=dataclasses.replace(SMALL, arch="modern"))
    with pytest.raises(UserError) as e:
        resume.choose(modern, run, True, FP)
    assert str(e.value) == (f"run dir {run}: refused to resume checkpoint step_0000002, which has "
                            "another model shape or optimizer (bias True -> False, rope False -> "
                            "True, norm layernorm -> rmsnorm, qk_norm False -> True, mlp gelu -> "
                            "swiglu, tie_embeddings True -> False); use another --run-dir, or "
                            "--reset to set the old run aside")
    wider = dataclasses.replace(config(), model=dataclasses.replace(SMALL, mlp_hidden=256))
    with pytest.raises(UserError, match=r"\(mlp_hidden 128 -> 256\)"):
        resume.choose(wider, run, True, FP)


def test_explicit_path_of_another_optimizer(run, other):
    """Muon's state (momentum buffers) is not AdamW's: switching optimizer is refused."""
    path = other.checkpoints / "step_0000004"
    cfg = config(str(path))
    cfg = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, name="muon"))
    with pytest.raises(UserError) as e:
        resume.choose(cfg, run, True, FP)
    assert "another model shape or optimizer (optim.name adamw -> muon)" in str(e.value)


def test_a_muon_checkpoint_under_adamw_is_refused_in_one_line(run):
    """The reverse, from the run dir: Muon's momentum cannot become AdamW's moments."""
    muon = dataclasses.replace(config(), optim=OptimConfig(name="muon"))
    meta = {"config": muon.to_dict(), "world_size": 2, "data_fingerprint": FP, "origin": None}
    store.save(run.checkpoints, 2, {"model": GPT(SMALL).state_dict()}, meta, keep=100)
    with pytest.raises(UserError) as e:
        choose(run)
    assert str(e.value) == (f"run dir {run.path}: refused to resume checkpoint step_0000002, "
                            "which has another model shape or optimizer (optim.name muon -> "
                            "adamw); use another --run-dir, or --reset to set the old run aside")


def test_where_a_run_starts_is_decided_once_per_process(tiny_data, tmp_path, monkeypatch,
                                                         one_thread):
    """One process trains, stops, and resumes: each start decides its starting point once
    (resume.plan, every file hashed) and hands that decision on to the run dir's claim."""
    from ddpgpt.cli import main
    from tests.helpers import tiny_train_args

    calls = []
    real = resume.plan
    monkeypatch.setattr(resume, "plan", lambda *a, **k: calls.append(k) or real(*a, **k))
    args = tiny_train_args(tiny_data, tmp_path / "run", steps=2, run__checkpoint_every=1)[3:]
    main(["train", *args])
    assert calls == [{"verify": True}]
    main(["train", *args, "--run.steps", "3"])  # resumes from step 2
    assert calls == [{"verify": True}] * 2
    assert [p.name for _, p in store.step_dirs(tmp_path / "run" / "checkpoints")][-1] == \
        "step_0000003"


def rollback_record(to: int | None, rollbacks: int = 1) -> dict:
    """What train's roll_back records (run/rollback.py), for a spike at step 9."""
    return {"to": to or 0, "checkpoint": None if to is None else f"step_{to:07d}",
            "rollbacks": rollbacks, "spike_step": 9, "first_step": 7, "read": 9, "before": [],
            "lr_factor": 1.0}


def test_a_recorded_rollback_supersedes_the_later_checkpoints_until_the_new_history_saves(run):
    """The rollback to step 3 is recorded while checkpoints 6 and 9 of the abandoned history are
    still there (a kill between the record and their move): a restart goes on from 3 with the
    rollback, and once the new history's checkpoint 4 is published the record is spent."""
    for step in (3, 6, 9):
        save(run, step)
    store.record_rollback(run.checkpoints, rollback_record(3))
    assert [s for s, _ in store.step_dirs(run.checkpoints)] == [3]
    assert store.find_latest(run.checkpoints)[0].name == "step_0000003"
    for first in (True, False):
        start = choose(run, first=first)
        assert (start.path.name, start.rollback) == ("step_0000003", rollback_record(3))
    assert sorted(p.name for p in store.superseded(run.checkpoints)) == \
        ["step_0000006", "step_0000009"]
    aside = resume.set_abandoned_aside(run, start)
    assert sorted(p.name for p in (aside / "checkpoints").iterdir()) == \
        ["step_0000006", "step_0000009"]
    save(run, 4, rollbacks=1)  # the new history: applied in it, the record is spent
    assert not (run.checkpoints / store.ROLLBACK).exists()
    start = choose(run)
    assert (start.path.name, start.rollback) == ("step_0000004", None)


def test_a_rollback_to_the_initial_state_restarts_from_scratch_with_it(run):
    save(run, 6)
    store.record_rollback(run.checkpoints, rollback_record(None))
    start = choose(run)
    assert (start.path, start.rollback) == (None, rollback_record(None))


def test_an_explicit_resume_elsewhere_leaves_a_recorded_rollback_behind(run):
    """--resume step 2 while a rollback to 3 is recorded: the user's checkpoint, without the
    rollback, and the record goes (else it would hide the new history's checkpoints)."""
    for step in (2, 3, 6):
        save(run, step)
    store.record_rollback(run.checkpoints, rollback_record(3))
    path = run.checkpoints / "step_0000002"
    start = choose(run, str(path))
    assert (start.path, start.rollback) == (path, None)
    resume.set_abandoned_aside(run, start)
    assert not (run.checkpoints / store.ROLLBACK).exists()
    save(run, 5, origin=start.origin)
    assert [s for s, _ in store.step_dirs(run.checkpoints)] == [2, 3, 5]


def test_allow_switch_applies_to_the_start_that_gives_it(run, monkeypatch):
    """A start that switched datasets with --data.allow-switch leaves it in config.json; the
    next start without the flag (train --run-dir R, or --resolved-config R/config.json) refuses
    another dataset again, as the first start before it did. The flag is no training setting
    (no config_change lists it), and a --nproc launcher hands its own start's to the workers."""
    from ddpgpt import cli
    from ddpgpt.run.launch import start_flags

    def parsed(*argv: str) -> TrainConfig:
        parser = cli._build_parser()
        ns = parser.parse_args(cli.bool_values(parser, ["train", *argv]))
        return cli.train_config({k: v for k, v in vars(ns).items()
                                 if k not in ("command", "debug")})[0]

    switched = dataclasses.replace(config(), data=DataConfig(dir="data", allow_switch=True),
                                   run=RunConfig(dir=str(run.path)))
    save(run, 4, fingerprint="cd" * 32)  # trained on other data than FP
    run.write_config(switched.to_dict(), 4, 1)
    for argv in (["--run-dir", str(run.path)], ["--resolved-config", str(run.config)]):
        cfg = parsed(*argv)
        assert not cfg.data.allow_switch, argv
        with pytest.raises(UserError, match="was trained on another dataset"):
            resume.choose(cfg, run, True, FP)
        again = parsed(*argv, "--data.allow-switch")
        assert resume.choose(again, run, True, FP).data_switch
        assert "data.allow_switch" not in changes.changes(again.to_dict(), cfg)
    assert start_flags(switched) == ["--run.resume", "auto", "--run.threads", "0",
                                     "--run.take-over", "false", "--data.allow-switch", "true"]


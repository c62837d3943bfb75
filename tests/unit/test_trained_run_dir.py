"""A run dir that has trained is never started over unless told (--reset): a first start that
finds no checkpoint to continue from, where metrics.jsonl shows training, is refused in one line
that names the step the run reached, where its checkpoints were and what is there now (its
checkpoints deleted, lost by the store, or looked for at another URL), but for one that stopped
before its first checkpoint was due, which starts over and says so; and a run continued on
another machine from its checkpoints' URL alone goes on on the processes it last trained on."""

from __future__ import annotations

import json
import shutil

import pytest

from ddpgpt import cli
from ddpgpt.checkpoint import store
from ddpgpt.config.schema import DataConfig, RunConfig, TrainConfig
from ddpgpt.errors import UserError
from ddpgpt.model.gpt import GPT
from ddpgpt.run import resume
from ddpgpt.run.run_dir import RunDir
from tests.helpers import SMALL

FP = "ab" * 32  # the dataset fingerprint these runs train on


def config(path, url: str = "", resume_mode: str = "auto", steps: int = 12,
           every: int = 3) -> TrainConfig:
    return TrainConfig(model=SMALL, data=DataConfig(dir="data"),
                       run=RunConfig(dir=str(path), checkpoint_url=url, resume=resume_mode,
                                     steps=steps, checkpoint_every=every))


def trained(path, url: str = "", steps: int = 6, every: int = 3, world_size: int = 1) -> RunDir:
    """A run dir as a training to `steps` leaves it: config.json (with its run.checkpoint_url),
    configs.jsonl, metrics.jsonl's rows (an evaluation before step 1 among them), and a
    checkpoint every `every` steps, in checkpoints/ or at `url`."""
    run = RunDir(path, url)
    run.create()
    cfg = config(path, url, every=every)
    run.write_config(cfg.to_dict(), 0, world_size)
    rows = [{"step": 0, "val_loss": 5.6}] + [{"step": s, "loss": 5.0 - s / 10}
                                              for s in range(1, steps + 1)]
    run.metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    for step in range(every, steps + 1, every):
        store.save(run.checkpoints, step, {"model": GPT(SMALL).state_dict()},
                   {"config": cfg.to_dict(), "world_size": world_size, "data_fingerprint": FP},
                   keep=100)
    return run


def refusal(run: RunDir, mode: str = "auto") -> str:
    cfg = config(run.path, run.url, mode)
    with pytest.raises(UserError) as e:
        resume.choose(cfg, run, True, FP)
    return str(e.value)


RESET = "or pass --reset to start over (its metrics go to reset-<time>/)"


def test_a_run_dir_whose_checkpoints_were_deleted_is_not_started_over(tmp_path):
    run = trained(tmp_path / "run")
    shutil.rmtree(run.checkpoints)
    for mode in ("auto", "never"):
        assert refusal(RunDir(run.path), mode) == (
            f"run dir {run} trained to step 6 (its metrics.jsonl), but no checkpoint of it is "
            f"left: {run.checkpoints} does not exist; refused to start it over from step 0: "
            f"put its checkpoints back there, {RESET}")
    run.checkpoints.mkdir()
    assert "left: " f"{run.checkpoints} holds no checkpoint; refused" in refusal(RunDir(run.path))
    assert resume.choose(config(run.path, resume_mode="reset"), run, True, FP).path is None


def test_the_command_line_refuses_before_it_writes_anything(tiny_data, tmp_path, capsys,
                                                           one_thread):
    """A run trained to step 3, its checkpoints/ deleted: `train --run-dir R --run.steps 4`
    exits 2 with the one line, and config.json, configs.jsonl and metrics.jsonl are as they
    were (before, the run started over at step 1 and cut metrics.jsonl to its new rows)."""
    from tests.helpers import tiny_train_args

    run = tmp_path / "run"
    cli.main(["train", *tiny_train_args(tiny_data, run, steps=3)[3:]])
    shutil.rmtree(run / "checkpoints")
    kept = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file() and p.name != ".lock"}
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        cli.main(["train", "--run-dir", str(run), "--run.steps", "4"])
    assert e.value.code == 2
    assert capsys.readouterr().err == (
        f"ddpgpt: error: run dir {run} trained to step 3 (its metrics.jsonl), but no checkpoint "
        f"of it is left: {run / 'checkpoints'} does not exist; refused to start it over from "
        f"step 0: put its checkpoints back there, {RESET}\n")
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()
            and p.name != ".lock"} == kept


def test_a_run_dir_that_stopped_before_its_first_checkpoint_starts_over_and_says_so(
        tmp_path, capsys):
    """Stopped at step 2 (a crash, a job killed and requeued) of a run that checkpoints every 3
    steps: there is nothing to continue from, so the same command starts over, with its metrics
    set aside as --reset sets them and a line that says why (nothing lost, nothing silent)."""
    from ddpgpt.distributed.group import DistEnv
    from ddpgpt.run import elastic

    run = trained(tmp_path / "run", steps=2)
    assert not run.checkpoints.exists()
    cfg = config(run.path)
    start = resume.choose(cfg, run, True, FP)
    why = (f"run dir {run} trained to step 2 (its metrics.jsonl), stopped before its first "
           "checkpoint was due (step 3, run.checkpoint_every = 3), so it starts over from step 0")
    assert start.path is None and start.over == why
    metrics = run.metrics.read_text()
    elastic.claim(run, cfg, DistEnv(), None, (cfg, start))
    aside = next(run.path.glob("reset-*"))
    assert (aside / "metrics.jsonl").read_text() == metrics and not run.metrics.exists()
    assert capsys.readouterr().err == (f"ddpgpt: {why}: moved the previous checkpoints and "
                                       f"metrics to {aside}\n")
    assert resume.choose(cfg, RunDir(run.path), True, FP).over == ""  # and it is no more


def test_a_run_training_here_now_is_named_busy_not_advised_a_reset(tmp_path):
    """Another run holds the run dir (training, its metrics ahead of its first checkpoint, or its
    checkpoints elsewhere): a second start is refused as the lock refuses it, naming the holder,
    and neither advised --reset nor started over over the live run's metrics."""
    from ddpgpt.run.run_dir import RunDirBusy

    for steps in (2, 6):  # before its first checkpoint was due; with checkpoints/ gone
        run = trained(tmp_path / f"run{steps}", steps=steps)
        shutil.rmtree(run.checkpoints, ignore_errors=True)
        run.lock()  # the live run (another open file description: flock refuses this one)
        try:
            with pytest.raises(RunDirBusy) as e:
                resume.choose(config(run.path), RunDir(run.path), True, FP)
            assert str(e.value).startswith(f"run dir {run.path} is in use by another run (PID ")
            assert "--reset" not in str(e.value) and run.metrics.is_file()
        finally:
            run.unlock()


def test_what_may_start_from_scratch_still_does(tmp_path):
    """A restart of the job (its first start trained from scratch and died before a checkpoint),
    a rollback to the initial state, and a run dir whose metrics hold no training step (only the
    evaluation before step 1) start from scratch as before."""
    run = trained(tmp_path / "run")
    shutil.rmtree(run.checkpoints)
    assert resume.choose(config(run.path), run, False, FP).path is None
    only_eval = trained(tmp_path / "eval", steps=0)
    assert resume.choose(config(only_eval.path), only_eval, True, FP).path is None
    rolled = trained(tmp_path / "rolled")
    store.record_rollback(rolled.checkpoints, {
        "to": 0, "checkpoint": None, "rollbacks": 1, "spike_step": 5, "first_step": 4, "read": 5,
        "before": [], "lr_factor": 1.0})
    start = resume.choose(config(rolled.path), rolled, True, FP)
    assert start.path is None and start.rollback["to"] == 0


def test_checkpoints_looked_for_elsewhere_name_where_they_are(s3, tmp_path):
    """Trained with its checkpoints in checkpoints/, continued with a URL that holds none; and
    trained at a URL, continued without one (--preset and --data: not the run's config.json)."""
    local = trained(tmp_path / "local")
    url = s3.bucket("empty") + "/run"
    assert refusal(RunDir(local.path, url)) == (
        f"run dir {local} trained to step 6 (its metrics.jsonl) with its checkpoints at "
        f"{local.checkpoints}, but this start looks for them at {url} (run.checkpoint_url), "
        "which holds no checkpoint; refused to start it over from step 0: without "
        f"--run.checkpoint-url it continues from step 6 in {local.checkpoints}, {RESET}")
    shutil.rmtree(local.checkpoints)  # and gone from there too
    assert refusal(RunDir(local.path, url)).endswith(
        f"which holds no checkpoint; refused to start it over from step 0: {local.checkpoints} "
        f"does not exist either: put its checkpoints back, {RESET}")
    remote = s3.bucket("ckpt") + "/run"
    at_url = trained(tmp_path / "remote", remote)
    assert refusal(RunDir(at_url.path, "")) == (
        f"run dir {at_url} trained to step 6 (its metrics.jsonl) with its checkpoints at "
        f"{remote}, but this start looks for them at {at_url.path / 'checkpoints'} (no "
        "run.checkpoint_url), which does not exist; refused to start it over from step 0: "
        f"--run.checkpoint-url {remote} continues it from step 6, {RESET}")


def test_a_mistyped_url_and_checkpoints_the_store_lost_are_refused(s3, tmp_path):
    """The run trained to step 12 at URL: continued with URL + "typo", nothing started over and
    nothing written; then the store loses its checkpoints and the same command is refused."""
    url = s3.bucket("ckpt") + "/k1"
    run = trained(tmp_path / "k1", url, steps=12)
    before = {p.name: p.read_bytes() for p in run.path.iterdir() if p.is_file()}
    assert refusal(RunDir(run.path, url + "typo")) == (
        f"run dir {run} trained to step 12 (its metrics.jsonl) with its checkpoints at {url}, "
        f"but this start looks for them at {url}typo (run.checkpoint_url), which holds no "
        f"checkpoint; refused to start it over from step 0: --run.checkpoint-url {url} "
        f"continues it from step 12, {RESET}")
    assert {p.name: p.read_bytes() for p in run.path.iterdir() if p.is_file()} == before
    s3.fs().rm(url[5:], recursive=True)  # a server restarted without its data
    assert refusal(RunDir(run.path)) == (
        f"run dir {run} trained to step 12 (its metrics.jsonl), but no checkpoint of it is "
        f"left: {url} holds no checkpoint; refused to start it over from step 0: put its "
        f"checkpoints back there, {RESET}")


# ---- the processes a run last trained on travel with its checkpoints --------------------------

def parsed(*argv: str) -> tuple[int | None, str]:
    """(--nproc, the lines to say) of `train ARGV` as the command line makes them."""
    parser = cli._build_parser()
    ns = parser.parse_args(cli.bool_values(parser, ["train", *argv]))
    _, nproc, _, notes = cli.train_config({k: v for k, v in vars(ns).items()
                                           if k not in ("command", "debug")})
    return nproc, notes


def test_a_new_machine_continues_on_the_processes_the_checkpoints_were_saved_on(s3, tmp_path):
    """Trained on 2 processes with its checkpoints at a URL: `train --run-dir NEW
    --run.checkpoint-url URL` on another machine (no configs.jsonl there) goes on on 2, and
    says so; --nproc says otherwise, and given --data it runs on 1 and says how to get 2."""
    url = s3.bucket("ckpt") + "/run"
    trained(tmp_path / "there", url, world_size=2)
    new = tmp_path / "new"
    assert parsed("--run-dir", str(new), "--run.checkpoint-url", url) == (
        2, f"ddpgpt: continuing run {new} on 2 processes, as it last trained (--nproc N for "
           "another number)")
    assert parsed("--run-dir", str(new), "--run.checkpoint-url", url, "--nproc", "1") == (1, "")
    assert parsed("--run-dir", str(new), "--run.checkpoint-url", url, "--data", "data") == (
        None, f"ddpgpt: run {new} last trained on 2 processes; given --data, this start runs on "
              "1 (--nproc 2 for 2)")

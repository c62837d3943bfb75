"""The run dir's lock, its archives, its logs at a checkpoint URL, and the launcher's part: one
process, no training."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from ddpgpt.checkpoint import store
from ddpgpt.config.io import build
from ddpgpt.model.gpt import GPT
from ddpgpt.run import launch, logs
from ddpgpt.run.run_dir import RunDir, RunDirBusy
from tests.helpers import REPO

HOLD = ("import sys, time; from ddpgpt.run.run_dir import RunDir; RunDir(sys.argv[1]).lock(); "
        "print('locked', flush=True); time.sleep(60)")


def holder(path):
    """Another process that takes the lock and keeps it."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(path)], stdout=subprocess.PIPE,
                            text=True, cwd=REPO)
    assert proc.stdout.readline() == "locked\n"
    return proc


def test_second_lock_names_the_holder_and_none_is_left_after_sigkill(tmp_path):
    run = RunDir(tmp_path / "run")
    proc = holder(run.path)
    try:
        with pytest.raises(RunDirBusy) as e:
            run.lock()
        info = json.loads(run.lock_file.read_text())
        assert str(e.value) == (f"run dir {run.path} is in use by another run (PID {proc.pid} on "
                                f"host {os.uname().nodename}, since {info['since']}); wait for it "
                                "to end or stop it, or use another --run-dir")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    run.lock()  # the kernel released the dead holder's lock: nothing stale to clean up
    assert json.loads(run.lock_file.read_text())["pid"] == os.getpid()
    run.unlock()


def test_a_worker_accepts_its_launchers_lock(tmp_path):
    """A child of the holder may run under the holder's lock (allow_parent); others may not."""
    run = RunDir(tmp_path / "run")
    run.lock()
    child = ("import sys; from ddpgpt.run.run_dir import RunDir, RunDirBusy\n"
             "r = RunDir(sys.argv[1]); r.lock(allow_parent=True)\n"
             "try:\n    r.lock()\nexcept RunDirBusy:\n    print('busy')\n")
    out = subprocess.run([sys.executable, "-c", child, str(run.path)], capture_output=True,
                         text=True, cwd=REPO)
    assert (out.returncode, out.stdout) == (0, "busy\n"), out.stderr
    run.unlock()


def test_set_aside_keeps_everything(tmp_path):
    run = RunDir(tmp_path / "run")
    (run.checkpoints / "step_0000002").mkdir(parents=True)
    run.metrics.write_text('{"step": 1}\n')
    first = run.set_aside("reset", [run.checkpoints, run.metrics])
    second_checkpoints = run.checkpoints / "step_0000004"
    second_checkpoints.mkdir(parents=True)
    # the same second: a new name, nothing merged
    second = run.set_aside("reset", [run.checkpoints])
    assert first != second and first.parent == second.parent == run.path
    assert (first / "checkpoints" / "step_0000002").is_dir() and (first / "metrics.jsonl").is_file()
    assert (second / "checkpoints" / "step_0000004").is_dir()
    assert not run.checkpoints.exists() and not run.metrics.exists()



def test_a_rewind_sets_the_later_checkpoints_aside_with_a_copy_of_the_metrics(tmp_path, capsys):
    """--resume PATH of this run dir (a rewind: not the spike guard's rollback) moves the
    checkpoints after PATH into rewind-<time>/ with a copy of metrics.jsonl, and says so."""
    run = RunDir(tmp_path / "run")
    later = [run.checkpoints / f"step_000000{s}" for s in (4, 6)]
    for path in [run.checkpoints / "step_0000002", *later]:
        path.mkdir(parents=True)
    run.metrics.write_text('{"step": 6}\n')
    run.rewind(later, 2)
    (aside,) = run.path.glob("rewind-*")
    assert sorted(p.name for p in (aside / "checkpoints").iterdir()) == ["step_0000004",
                                                                        "step_0000006"]
    assert [p.name for p in run.checkpoints.iterdir()] == ["step_0000002"]
    assert (aside / "metrics.jsonl").read_text() == run.metrics.read_text()
    assert capsys.readouterr().err == (
        "ddpgpt: --resume: continuing from step 2; moved the later checkpoints (step_0000004, "
        f"step_0000006) and a copy of the metrics to {aside}\n")

def save(root, step, reason, saved_at=None):
    model = GPT(build(None, None, {"model": {"n_layer": 1, "n_head": 1, "n_embd": 8,
                                             "block_size": 4, "vocab_size": 16}}).model)
    path = store.save(root, step, {"model": model.state_dict()}, {"reason": reason}, keep=10)
    if saved_at is not None:
        meta = json.loads((path / "meta.json").read_text())
        meta["saved_at"] = saved_at
        (path / "meta.json").write_text(json.dumps(meta))
    return path


def test_launcher_claims_only_a_stop_checkpoint_written_since_it_started(tmp_path):
    """After a signal the launcher names a checkpoint only if the workers wrote one for the stop
    after it started; an older stop checkpoint or a scheduled one is not theirs."""
    run = RunDir(tmp_path / "run")
    started = time.time()
    save(run.checkpoints, 2, "stop", saved_at=started - 60)  # a previous job's stop
    assert launch.stop_checkpoint(run, since=started) is None
    save(run.checkpoints, 3, "scheduled")
    assert launch.stop_checkpoint(run, since=started) is None
    path = save(run.checkpoints, 4, "stop")
    assert launch.stop_checkpoint(run, since=started) == path


def test_launcher_starts_workers_from_the_resolved_config_under_its_lock(tiny_data, tmp_path,
                                                                         monkeypatch):
    """--nproc: the argv is parsed and resolved once; the workers get the run's config.json (no
    `auto` in it) and this start's run.resume, run.threads, run.take_over and data.allow_switch,
    and the schedule's end as settled here, and the run dir is locked while they run."""
    seen = {}

    def start(nproc, worker_args, max_restarts=0):
        seen.update(nproc=nproc, args=worker_args, max_restarts=max_restarts,
                    config=json.loads(RunDir(tmp_path / "run").config.read_text()))
        with pytest.raises(RunDirBusy):
            RunDir(tmp_path / "run").lock()
        return 0, None

    monkeypatch.setattr(launch, "start", start)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = build("tiny", None, {"data": {"dir": str(tiny_data)},
                               "run": {"dir": str(tmp_path / "run")}})
    assert launch.train(cfg, 2, 1) == 0
    threads = max(1, len(os.sched_getaffinity(0)) // 2)
    # and this start's own settings, which a run's config.json does not carry to its next start
    assert seen["args"] == ["train", "--resolved-config", str(tmp_path / "run" / "config.json"),
                            "--run.resume", "auto", "--run.threads", str(threads),
                            "--run.take-over", "false", "--data.allow-switch", "false",
                            "--optim.decay-steps", "200"]
    assert (seen["nproc"], seen["max_restarts"]) == (2, 1)
    assert seen["config"]["run"]["device"] == "cpu" and seen["config"]["model"]["vocab_size"] == 257
    assert seen["config"]["run"]["threads"] == max(1, len(os.sched_getaffinity(0)) // 2)


def test_configs_jsonl_records_each_start_that_changed_its_config_or_world_size(tmp_path):
    run = RunDir(tmp_path / "run")
    run.create()
    a, b = {"run": {"steps": 10}}, {"run": {"steps": 20}}
    for config, step, world in ((a, 0, 2), (a, 0, 2), (a, 4, 2), (a, 6, 1), (b, 8, 1),
                                (b, 2, 1)):  # the last: back to an older checkpoint
        run.write_config(config, step, world)
    starts = [json.loads(line) for line in run.configs.read_text().splitlines()]
    assert [(s["step"], s["world_size"], s["config"]) for s in starts] == [
        (0, 2, a), (6, 1, a), (8, 1, b), (2, 1, b)]
    assert json.loads(run.config.read_text()) == b


def test_the_logs_at_a_checkpoint_url_are_taken_back_only_when_they_go_further(s3, tmp_path):
    """run/logs.py: a start whose metrics.jsonl ends before the URL's copy (a new machine, a node
    that was not rank 0) takes the URL's metrics.jsonl and configs.jsonl; one that goes further
    (rows after the last checkpoint, which its resume cuts) keeps its own; share puts them back."""
    url = s3.bucket("logs") + "/run"
    run = RunDir(tmp_path / "run", url)
    run.create()

    def rows(*steps):
        return "".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in steps).encode()

    fs, there = s3.fs(), {"metrics.jsonl": rows(1, 2, 3, 4), "configs.jsonl": b'{"step": 0}\n'}
    for name, data in there.items():
        fs.pipe_file(f"{url[5:]}/{name}", data)
    run.metrics.write_bytes(rows(1, 2, 3, 4, 5))
    run.write_config({"a": 1}, 4, 1)
    assert run.metrics.read_bytes() == rows(1, 2, 3, 4, 5)  # further: its own
    assert [json.loads(line)["step"] for line in run.configs.read_text().splitlines()] == [4]
    run.metrics.write_bytes(rows(1, 2))
    run.write_config({"a": 1}, 4, 1)
    assert run.metrics.read_bytes() == there["metrics.jsonl"]  # behind: the URL's
    assert run.configs.read_bytes().startswith(there["configs.jsonl"])  # then this start's
    logs.share(run)
    for name in logs.SHARED:
        assert fs.cat_file(f"{url[5:]}/{name}") == (run.path / name).read_bytes(), name


@pytest.mark.parametrize("made", ["run", "parent"])
def test_another_ranks_probe_between_two_looks_is_not_a_file(tmp_path, monkeypatch, made):
    """Every rank checks the run dir before the group exists, and a check may mkdir and rmdir a
    missing directory to see that it can: a rank that saw the run dir (or a missing parent of it)
    there, and then gone, once read that as "is a file" and left alone while the others waited
    in the group. Here the directory is removed right after the first look at it."""
    target = tmp_path / "a" / "run" if made == "parent" else tmp_path / "run"
    probed = target.parent if made == "parent" else target
    probed.mkdir()
    real, looked = os.stat, []

    def stat_then_gone(path, *args, **kwargs):
        out = real(path, *args, **kwargs)
        if os.fspath(path) == str(probed) and not looked:
            looked.append(path)
            os.rmdir(probed)  # the other rank's rmdir, between this look and the next
        return out

    monkeypatch.setattr(os, "stat", stat_then_gone)
    RunDir(target).check_creatable()  # no error: what it saw was a directory
    assert looked and not target.exists()  # the race happened; the check leaves nothing

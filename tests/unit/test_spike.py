"""The pieces of spike rollback and elastic starts, one process: the detector against a median
taken by hand, the guard's decision for every setting, the loader's skip against the documented
order, the world sizes an elastic range must split for, the lock a restart waits for, and the
run dir's record of a job's launchers."""

import statistics
import threading
import time

import numpy as np
import pytest

from ddpgpt.config import ConfigError, DataConfig, RunConfig, TrainConfig
from ddpgpt.data.loader import TrainLoader
from ddpgpt.data.shards import TokenDataset
from ddpgpt.dist import DistEnv, DistError, parse_nnodes
from ddpgpt.elastic import first_start
from ddpgpt.preflight import check_world_sizes
from ddpgpt.reliability import Guard, Health, StopSignal
from ddpgpt.run_dir import RunDir, RunDirBusy
from ddpgpt.spike import Spike, SpikeDetector
from tests.helpers import reference_step, write_dataset


def test_the_detector_compares_with_the_median_of_its_window():
    detector = SpikeDetector(RunConfig(spike_window=3, spike_ratio=2.0))
    losses = [5.0, 4.0, 9.0]  # the window fills; nothing is compared before
    assert [detector.check(k + 1, x) for k, x in enumerate(losses)] == [None] * 3
    median = statistics.median(losses)  # 5: a single outlier does not move it
    assert detector.check(4, 2 * median) is None  # not above: joins the window
    spike = detector.check(5, 2 * statistics.median([4.0, 9.0, 10.0]) + 0.01)
    assert spike == Spike(5, 18.01, 9.0)
    assert list(detector.losses) == [4.0, 9.0, 10.0]  # a spike never joins the window


def test_the_detector_state_round_trips_and_old_checkpoints_start_fresh():
    cfg = RunConfig(spike_window=2)
    detector = SpikeDetector(cfg)
    detector.check(1, 3.0)
    detector.rollbacks, detector.lr_until = [{"step": 6, "to": 3, "batches": 3}], 9
    again = SpikeDetector(cfg)
    again.load_state_dict(detector.state_dict())
    assert again.state_dict() == {"losses": [3.0], "lr_until": 9,
                                  "rollbacks": [{"step": 6, "to": 3, "batches": 3}]}
    assert (again.lr_scale(9), again.lr_scale(10)) == (cfg.rollback_lr_factor, 1.0)
    again.load_state_dict(None)
    assert again.state_dict() == {"losses": [], "rollbacks": [], "lr_until": 0}


def guard(**run) -> Guard:
    g = Guard(DistEnv(), RunConfig(spike_window=2, **run), StopSignal(announce=False))
    for step, loss in ((1, 4.0), (2, 4.0)):
        assert g.judge(step, Health(loss, [], False), last_checkpoint=-1) == "update"
    return g


NAN, SPIKE = Health(float("nan"), [1], False), Health(9.0, [], False)


@pytest.mark.parametrize("on_nonfinite, on_spike, health, outcome", [
    ("spike", "rollback", NAN, Spike(3, float("nan"), 4.0, [1])),
    ("spike", "rollback", SPIKE, Spike(3, 9.0, 4.0)),
    ("skip", "rollback", NAN, "skip"),           # skipping is the non-finite remedy asked for
    ("spike", "none", SPIKE, "update"),          # finite spikes pass
    ("spike", "none", NAN, "step 3: non-finite loss or gradient norm on rank 1; stopped before "
     "the optimizer step (run.on_spike = none). The last checkpoint (step 2) is intact; lower "
     "optim.lr or raise optim.warmup_steps, or use --run.on-spike rollback"),
    ("spike", "stop", SPIKE, "step 3: loss spike: 9 is above 2 × the median 4 of the last 2 "
     "steps; stopped before the optimizer step (run.on_spike = stop). The last checkpoint (step "
     "2) is intact; lower optim.lr or raise optim.warmup_steps, or use --run.on-spike rollback"),
    ("stop", "rollback", NAN, "step 3: non-finite loss or gradient norm on rank 1; stopped "
     "before the optimizer step. The last checkpoint (step 2) is intact; lower optim.lr or raise "
     "optim.warmup_steps, or use --on-nonfinite skip"),
])
def test_what_a_bad_step_leads_to(on_nonfinite, on_spike, health, outcome):
    """One story for both knobs: a non-finite value is a spike unless run.on_nonfinite says
    stop or skip; run.on_spike decides for spikes, and none never trains through a NaN."""
    g = guard(on_nonfinite=on_nonfinite, on_spike=on_spike)
    if isinstance(outcome, str) and outcome.startswith("step"):
        with pytest.raises(DistError) as e:
            g.judge(3, health, last_checkpoint=2)
        assert str(e.value) == outcome
        return
    verdict = g.judge(3, health, last_checkpoint=2)
    if isinstance(outcome, Spike) and outcome.ranks:  # nan != nan
        assert (verdict.step, verdict.median, verdict.ranks) == (3, 4.0, [1])
    else:
        assert verdict == outcome


def test_rollbacks_are_counted_within_their_window():
    g = guard(max_rollbacks=2, rollback_window=10)
    g.spikes.rollbacks = [{"step": 3, "to": 0, "batches": 3}, {"step": 8, "to": 5, "batches": 3}]
    with pytest.raises(DistError, match=r"after 2 rollbacks within 10 steps "
                                        r"\(run.max_rollbacks = 2\)"):
        g.judge(12, SPIKE, last_checkpoint=10)
    assert isinstance(g.judge(13, SPIKE, last_checkpoint=10), Spike)  # step 3 is out of the window


def test_skipping_batches_moves_the_global_cursor_as_reading_them_would(tmp_path):
    """After skip(n), every rank at any W reads what a straight run reads n batches later, across
    an epoch's end too; the ranges name the skipped windows' positions in each epoch's order."""
    stream = np.arange(4 * 8 * 5 + 7, dtype=np.int64) % 251  # 41 windows of T=4: 5 steps/epoch
    ds = TokenDataset(write_dataset(tmp_path / "d", stream, stream[:64], 256))
    G, T = 8, 4
    for W in (1, 2, 4):
        loaders = [TrainLoader(ds, seq_len=T, micro_batch=2, world_size=W, rank=r,
                               accum_steps=G // (2 * W)) for r in range(W)]
        for loader in loaders:
            loader.next_step()                   # batch 0
            ranges = loader.skip(6)              # batches 1-4 of epoch 0, 5-6 (epoch 1's 0-1)
            assert loader.batch_index == 7
        assert ranges == [{"epoch": 0, "start": 8, "end": 40}, {"epoch": 1, "start": 0, "end": 16}]
        rows = np.concatenate([np.concatenate([x.numpy() for x, _ in lo.next_step()])
                               for lo in loaders])
        expected = reference_step(stream, 0, T, G, 7)[:, :-1]
        assert sorted(map(tuple, rows)) == sorted(map(tuple, expected))


def test_an_elastic_range_must_split_the_global_batch_for_every_world_size():
    cfg = TrainConfig(data=DataConfig(global_batch=24, micro_batch=2))
    check_world_sizes(cfg, (1, 3), 2)  # W = 2, 4, 6: 24 splits for each
    with pytest.raises(ConfigError) as e:
        check_world_sizes(cfg, (1, 4), 2)
    assert str(e.value) == (
        "torchrun --nnodes 1:4 (2 processes per node) lets the job restart at world size 2, 4, "
        "6, 8, but data.global_batch = 24 is not divisible by W × data.micro_batch for W = 8; "
        "make the global batch a multiple of 48, or change the micro-batch or the --nnodes range")


def test_the_nnodes_range_is_read_from_torchruns_command_line():
    torchrun = ["python", "-m", "torch.distributed.run"]
    assert parse_nnodes([*torchrun, "--nnodes", "1:4", "-m", "ddpgpt"], None) == (1, 4)
    assert parse_nnodes([*torchrun, "--nnodes=2"], "1:4") == (2, 2)
    assert parse_nnodes([*torchrun, "--standalone"], None) == (1, 1)
    assert parse_nnodes(torchrun, "2:3") == (2, 3)  # PET_NNODES
    assert parse_nnodes(torchrun, None) is None


def test_a_restart_waits_for_the_lock_of_a_process_that_is_going(tmp_path):
    held = RunDir(tmp_path / "run")
    held.lock()
    with pytest.raises(RunDirBusy):
        RunDir(tmp_path / "run").lock()  # a first start does not wait
    threading.Timer(1.0, held.unlock).start()
    start = time.monotonic()
    waiting = RunDir(tmp_path / "run")
    waiting.lock(wait_s=30)
    assert 0.5 < time.monotonic() - start < 20
    waiting.unlock()


def test_the_run_dir_knows_the_launchers_of_the_job_that_trains_there(tmp_path):
    run = RunDir(tmp_path / "run")
    run.create()
    assert run.known_launchers() == set()
    run.record_job({"a:1:10", "b:2:20"}, first_start=True)
    run.record_job({"b:2:20", "c:3:30"}, first_start=False)  # a node joined the same job
    assert run.known_launchers() == {"a:1:10", "b:2:20", "c:3:30"}
    run.record_job({"d:4:40"}, first_start=True)  # a new job forgets the old one's
    assert run.known_launchers() == {"d:4:40"}


def test_a_start_is_the_jobs_first_unless_one_of_its_launchers_started_it(tmp_path):
    """torch's store, which counts the attempts, dies with the node that hosts it; the run dir's
    record of launchers does not. A new torchrun is a new job; no launcher, no restart."""
    run = RunDir(tmp_path / "run")
    run.create()
    agent = DistEnv(launcher="node0:100:5")
    assert first_start(run, agent) == (True, {"node0:100:5"})
    run.record_job({"node0:100:5"}, first_start=True)
    assert first_start(run, agent)[0] is False
    assert first_start(run, DistEnv(launcher="node0:100:6"))[0] is True  # its PID reused
    assert first_start(run, DistEnv())[0] is True

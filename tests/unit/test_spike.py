"""The pieces of spike rollback and elastic starts, one process: the detector against a median
taken by hand, the guard's decision for every setting, the loader's skip against the documented
order, the world sizes an elastic range must split for, the lock a restart waits for, and the
run dir's record of a job's launchers."""

import math
import statistics
import threading
import time

import numpy as np
import pytest

from ddpgpt.checkpoint import store
from ddpgpt.config.checks import ConfigError
from ddpgpt.config.schema import DataConfig, RunConfig, TrainConfig
from ddpgpt.data.loader import TrainLoader
from ddpgpt.data.shards import TokenDataset
from ddpgpt.distributed.group import DistEnv, DistError, parse_nnodes
from ddpgpt.guard.health import Guard, Health, StopSignal
from ddpgpt.guard.spike import UPDATE, SpikePolicy, Verdict, target
from ddpgpt.run.elastic import first_start
from ddpgpt.run.preflight import check_world_sizes
from ddpgpt.run.run_dir import RunDir, RunDirBusy
from tests.helpers import reference_step, write_dataset


def test_the_detector_compares_with_the_median_of_its_window():
    policy = SpikePolicy(RunConfig(spike_window=3, spike_ratio=2.0))
    losses = [5.0, 4.0, 9.0]  # the window fills; nothing is compared before
    assert [policy.outlier(x) for x in losses] == [False] * 3
    for k, x in enumerate(losses):
        policy.healthy(k + 1, x, batch=k)
    median = statistics.median(losses)  # 5: a single outlier does not move it
    assert not policy.outlier(2 * median)  # not above
    assert policy.outlier(2 * median + 0.01) and policy.outlier(float("nan"))
    assert (policy.median, policy.probe_batch) == (5.0, 2)


def test_the_policy_state_round_trips_and_old_checkpoints_keep_their_window():
    cfg = RunConfig(spike_window=2)
    policy = SpikePolicy(cfg)
    policy.healthy(1, 3.0, batch=0)
    policy.through, policy.lr_factor = 4, 0.25
    policy.rollbacks = [{"step": 6, "to": 3, "batches": 3}]
    again = SpikePolicy(cfg)
    again.load_state_dict(policy.state_dict())
    policy.confirm(0)
    again.load_state_dict(policy.state_dict())
    assert again.state_dict() == {"losses": [3.0], "through": 4, "skips": 0, "probe_batch": 0,
                                  "lr_factor": 0.25,
                                  "rollbacks": [{"step": 6, "to": 3, "batches": 3}],
                                  "healthy_checkpoints": [0], "lately": [],
                                  "best": [math.inf, 0], "val": [math.inf, math.inf, 0],
                                  "first": [math.inf, 0], "data_skips": 0,
                                  # through a spike without its trouble: saved before it was
                                  "trouble": {"step": 4, "median": 3.0, "val": "inf"}}
    # a checkpoint of the earlier policy (a temporary lr cut) keeps its window and rollbacks
    again.load_state_dict({"losses": [2.0], "rollbacks": [], "lr_until": 9})
    assert again.state_dict() == {"losses": [2.0], "through": 0, "skips": 0, "probe_batch": -1,
                                  "lr_factor": 1.0, "rollbacks": [],
                                  "healthy_checkpoints": None,  # any checkpoint may be healthy
                                  "lately": [], "best": [math.inf, 0],
                                  "val": [math.inf, math.inf, 0], "first": [math.inf, 0],
                                  "data_skips": 0, "trouble": None}
    again.load_state_dict(None)
    assert again.state_dict() == SpikePolicy(cfg).state_dict()


class Probe:
    """A stand-in for Trainer.probe: the loss of the weights on a batch, and who asked."""

    def __init__(self, loss: float):
        self.loss, self.asked = loss, []

    def __call__(self, batch: int) -> float:
        self.asked.append(batch)
        return self.loss


def guard(tmp_path=None, **run) -> Guard:
    """A guard whose window (2 steps) holds 4.0, 4.0, the second read global batch 1."""
    g = Guard(DistEnv(), RunConfig(spike_window=2, **run), StopSignal(announce=False),
              checkpoints=tmp_path)
    for step, loss in ((1, 4.0), (2, 4.0)):
        assert g.judge(step, Health(loss, [], False), step - 1, Probe(4.0)).action == "update"
    return g


NAN, SPIKE = Health(float("nan"), [1], False), Health(9.0, [], False)


def test_a_spike_the_data_caused_skips_its_update():
    """The weights still do as well on the last healthy batch: the batch is the cause."""
    g, probe = guard(), Probe(4.3)
    verdict = g.judge(3, SPIKE, 2, probe)
    assert (verdict.action, verdict.event, verdict.fields) == ("skip", "skip", {
        "cause": "data", "probe_loss": 4.3})
    assert probe.asked == [1]  # the batch of step 2, the newest healthy one
    assert verdict.line == ("step 3: loss spike: 9 is above 2 × the median 4 of the last 2 "
                            "steps; the weights still give 4.3 on the last healthy batch, so the "
                            "data is the cause: this step's update is skipped")
    assert g.judge(4, Health(4.2, [], False), 4, probe) == UPDATE  # no spike is open
    assert g.skipped == 0  # skipping bad data is not skipping a non-finite step


def test_a_spike_the_weights_caused_is_trained_through_until_it_heals():
    """Healed: back near the median before the spike (at most 1.1 × 4), not merely under the
    spike ratio: 6 is no spike of its own, but the spike is not over, and 6 does not join the
    window."""
    g, probe = guard(spike_patience=4), Probe(9.5)
    verdict = g.judge(3, SPIKE, 2, probe)
    assert (verdict.action, verdict.event, verdict.fields["cause"]) == ("update", "spike",
                                                                        "weights")
    assert g.judge(4, SPIKE, 3, probe).action == "update" and probe.asked == [1]  # no new probe
    still = g.judge(5, Health(6.0, [], False), 4, probe)
    assert (still.action, still.event, still.spike.loss) == ("update", None, 6.0)
    assert still.spike.describe(2.0, 2) == ("the loss 6 is not back near the median 4 before "
                                            "the spike: above 4.4")
    healed = g.judge(6, Health(4.3, [], False), 5, probe)
    assert (healed.action, healed.event, healed.fields) == ("update", "recovered", {
        "spike_step": 3, "loss_now": 4.3, "median": 4.0, "bound": pytest.approx(4.4)})
    assert healed.line == ("step 6: recovered: the loss 4.3 is back near the median 4 before "
                           "the spike at step 3 (at most 4.4), trained through (3 steps)")
    assert list(g.spikes.losses) == [4.0, 4.3] and g.spikes.through == 0
    assert g.spikes.trouble is None and g.end(6) is None


def test_weights_that_do_not_heal_roll_back_then_train_on_once_rollbacks_do_not_help():
    g = guard(spike_patience=2, max_rollbacks=1, rollback_window=50)
    probe = Probe(20.0)
    assert [g.judge(s, SPIKE, s - 1, probe).action for s in (3, 4)] == ["update", "update"]
    rollback = g.judge(5, SPIKE, 4, probe)
    assert (rollback.action, rollback.first, rollback.spike.step) == ("rollback", 3, 5)
    g.spikes.rolled_back(5, 0, 5)
    assert g.spikes.lr_factor == 0.5  # for the rest of the run
    assert [g.judge(s, SPIKE, s - 1, probe).action for s in (6, 7)] == ["update", "update"]
    given_up = g.judge(8, SPIKE, 7, probe)  # a second rollback is past run.max_rollbacks
    assert (given_up.action, given_up.event, given_up.first) == ("update", "give_up", 6)
    assert given_up.fields == {"why": "1 rollbacks within 50 steps have not helped "
                                      "(run.max_rollbacks = 1)"}
    assert g.judge(9, SPIKE, 8, probe) == Verdict("update", g.judge(9, SPIKE, 8, probe).spike)


def test_bad_data_on_every_batch_for_the_patience_is_a_new_domain_trained_on():
    """spike_patience finite spikes in a row on weights that stay fine on the last healthy batch,
    and one more: the data itself has changed (unshuffled data reaching a new domain). The run
    trains on it, the window starts over from that loss, and no spike is looked for until it is
    full again; a healthy step in between ends a streak."""
    g, probe = guard(spike_patience=3), Probe(4.0)
    assert [g.judge(s, SPIKE, s - 1, probe).action for s in (3, 4, 5)] == ["skip"] * 3
    shift = g.judge(6, SPIKE, 5, probe)
    assert (shift.action, shift.event, shift.fields) == ("update", "shift", {
        "cause": "data", "probe_loss": 4.0, "skipped": 3})
    assert shift.line == ("step 6: loss spike: 9 is above 2 × the median 4 of the last 2 steps; "
                          "4 global batches in a row spiked while the weights still give 4 on the "
                          "last healthy batch: the data itself has changed, so the run trains on "
                          "it from here (the 3 skipped before it stay skipped), and the median "
                          "and the lowest losses its end is judged by start over")
    assert list(g.spikes.losses) == [9.0] and g.spikes.skips == 0
    assert g.judge(7, Health(30.0, [], False), 6, probe) == UPDATE  # the window is not full
    assert g.spikes.median == 19.5 and probe.asked == [1] * 4
    g = guard(spike_patience=3)
    assert g.judge(3, SPIKE, 2, probe).action == "skip"
    assert g.judge(4, Health(4.0, [], False), 3, probe) == UPDATE  # a healthy step ends the run
    assert [g.judge(s, SPIKE, s - 1, probe).action for s in (5, 6, 7)] == ["skip"] * 3


def test_non_finite_steps_on_every_batch_for_the_patience_are_the_weights_after_all():
    """The probe's one batch may be the only one the weights still get right (fp16 overflowing
    on every other batch): non-finite skips in a row are capped by run.spike_patience, then it
    rolls back from the first of them."""
    g, probe = guard(spike_patience=3), Probe(4.0)
    assert [g.judge(s, NAN, s - 1, probe).action for s in (3, 4, 5)] == ["skip"] * 3
    rollback = g.judge(6, NAN, 5, probe)
    assert (rollback.action, rollback.first) == ("rollback", 3)


def test_a_non_finite_step_the_weights_caused_rolls_back_at_once():
    g = guard(max_rollbacks=1)
    verdict = g.judge(3, NAN, 2, Probe(float("inf")))
    assert (verdict.action, verdict.first, verdict.spike.ranks) == ("rollback", 3, [1])
    g.spikes.rolled_back(3, 0, 3)
    skipped = g.judge(4, NAN, 3, Probe(float("nan")))  # rollbacks exhausted: skipped, counted
    assert (skipped.action, skipped.fields["cause"], g.skipped) == ("skip", "nonfinite", 1)


def test_a_non_finite_step_on_healthy_weights_is_skipped_as_bad_data():
    verdict = guard().judge(3, NAN, 2, Probe(4.0))
    assert (verdict.action, verdict.fields["cause"]) == ("skip", "data")


@pytest.mark.parametrize("on_nonfinite, on_spike, health, outcome", [
    ("skip", "recover", NAN, "skip"),            # skipping is the non-finite remedy asked for
    ("spike", "none", SPIKE, "update"),          # finite spikes pass
    ("spike", "none", NAN, "step 3: non-finite loss or gradient norm on rank 1; stopped before "
     "the optimizer step (run.on_spike = none). The checkpoint {c2} was written after the "
     "trouble began (the update before step 3 may be its cause), and a plain rerun would resume "
     "from it; the newest healthy checkpoint is {c1}: to resume from it, run the same command "
     "with --resume {c1}; lower optim.lr or raise optim.warmup_steps, or use --run.on-spike "
     "recover"),
    ("spike", "stop", SPIKE, "step 3: loss spike: 9 is above 2 × the median 4 of the last 2 "
     "steps; stopped before the optimizer step (run.on_spike = stop). The checkpoint {c2} was "
     "written after the trouble began (the update before step 3 may be its cause), and a plain "
     "rerun would resume from it; the newest healthy checkpoint is {c1}: to resume from it, run "
     "the same command with --resume {c1}; lower optim.lr or raise optim.warmup_steps, or use "
     "--run.on-spike recover"),
    ("stop", "recover", NAN, "step 3: non-finite loss or gradient norm on rank 1; stopped "
     "before the optimizer step. The checkpoint {c2} was written after the trouble began (the "
     "update before step 3 may be its cause), and a plain rerun would resume from it; the newest "
     "healthy checkpoint is {c1}: to resume from it, run the same command with --resume {c1}; "
     "lower optim.lr or raise optim.warmup_steps, or use --on-nonfinite skip"),
])
def test_what_a_bad_step_leads_to(on_nonfinite, on_spike, health, outcome, tmp_path):
    """One story for both knobs: a non-finite value is a spike unless run.on_nonfinite says
    stop or skip; run.on_spike decides for spikes, and none never trains through a NaN. A stop
    names the newest checkpoint known healthy, never the one written just before the spike."""
    c1, c2 = (store.step_dir(tmp_path, s) for s in (1, 2))
    for c in (c1, c2):
        c.mkdir()
    g = guard(tmp_path, on_nonfinite=on_nonfinite, on_spike=on_spike)
    if outcome.startswith("step"):
        with pytest.raises(DistError) as e:
            g.judge(3, health, 2, Probe(4.0))
        assert str(e.value) == outcome.format(c1=c1, c2=c2)
        return
    assert g.judge(3, health, 2, Probe(4.0)).action == outcome


def test_the_rollback_target_is_the_newest_healthy_checkpoint_and_goes_further_back_on_repeat():
    steps = [5, 10, 15]
    assert target(steps, first=16, origin=0, rollbacks=[]) == 10  # 15 holds the cause
    assert target(steps, first=17, origin=0, rollbacks=[]) == 15
    assert target(steps, first=16, origin=0, rollbacks=[{"step": 14, "to": 10}]) == 5
    assert target(steps, first=6, origin=0, rollbacks=[]) is None  # the initial state
    assert target(steps, first=16, origin=12, rollbacks=[]) is None  # before this process
    # known healthy only: 10 was followed by a skipped (spiking) step, so 5 is the target
    assert target(steps, first=16, origin=0, rollbacks=[], known=[5]) == 5
    assert target(steps, first=16, origin=0, rollbacks=[], known=[]) is None


def test_a_checkpoint_is_known_healthy_once_its_next_step_is_and_the_newest_is_never_pruned(
        tmp_path):
    """The domain shift that reset a run to step 0: checkpoints every 5, keep 3, a streak of
    skips from step 80 on. The checkpoints of the streak (80, 85, 90) are not known healthy; the
    one of step 75 is, and keep-last-k keeps it beside the newest 3."""
    policy = SpikePolicy(RunConfig())
    for step in (70, 75):
        policy.confirm(step)
    policy.confirm(75)
    assert (policy.healthy_checkpoints, policy.newest_healthy) == ([70, 75], 75)
    for step in range(20, 100, 5):
        store.save(tmp_path, step, {"model": {}}, {}, keep=3,
             protect=policy.newest_healthy)
    assert [s for s, _ in store.step_dirs(tmp_path)] == [75, 85, 90, 95]
    assert target([75, 85, 90, 95], first=96, origin=0, rollbacks=[],
                  known=policy.healthy_checkpoints) == 75


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

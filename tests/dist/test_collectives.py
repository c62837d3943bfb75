"""Gradient sync once per step, eval all-reduce equal to one process, the startup agreement
check."""

import json

import pytest

from ddpgpt.distributed.group import DistEnv
from tests.dist import workers
from tests.helpers import tiny_train_args
from tests.processes import codes, run_ranks

pytestmark = [pytest.mark.dist, pytest.mark.timeout(180)]


def worker(tmp_path, W, name, **args):
    out = tmp_path / f"{name}.json"
    run_ranks([["-m", "tests.dist.workers", name, json.dumps(args), str(out)]] * W,
              tmp_path / f"{name}-logs")
    return json.loads(out.read_text())


def test_ranks_that_stop_for_another_exit_with_its_code(tmp_path):
    """Bad input on rank 0 (exit 2): the others stop quietly with exit 2 too, so the launcher,
    which reports whichever worker exited first, says 2 whichever that is."""
    assert worker(tmp_path, 3, "fail_on_main") == [[2, False], [2, True], [2, True]]


MAX_WINDOWS = [0, 13]


@pytest.fixture(scope="module")
def eval_at_w3(tiny_data, tmp_path_factory):
    """max_windows -> the W=3 evaluation's loss, every setting in one launch."""
    losses = worker(tmp_path_factory.mktemp("eval"), 3, "eval_losses", data=str(tiny_data),
                    max_windows=MAX_WINDOWS)
    return dict(zip(MAX_WINDOWS, losses))


@pytest.mark.parametrize("max_windows", MAX_WINDOWS)
def test_eval_all_reduce_equals_single_process(eval_at_w3, tiny_data, max_windows):
    single = workers.eval_loss(DistEnv(), str(tiny_data), max_windows)  # one process: every window
    # W=3 and b=3: the windows do not divide evenly, so some ranks evaluate padding rows.
    assert eval_at_w3[max_windows] == pytest.approx(single, rel=1e-6)


def test_gradients_sync_once_per_step(tiny_data, tmp_path):
    """A = 3 micro-steps: in each step DDP all-reduces every bucket once (not three times), and
    the ranks end every step with identical gradients (checked in the worker)."""
    per_step = worker(tmp_path, 2, "count_allreduces", data=str(tiny_data),
                      run_dir=str(tmp_path / "run"), accum=3, steps=3)
    assert len(per_step) == 3
    for buckets in per_step:
        assert sorted(buckets) == list(range(len(buckets)))  # each bucket index exactly once
    assert len(per_step[-1]) >= 2  # bucket_mb is tiny: several buckets, so "once" is not trivial


@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_startup_check_catches_different_init(tiny_data, tmp_path, mode):
    """Rank 1 builds its model from another seed: every rank stops with one line from rank 0 that
    names both differences, the cause (the config) first. Under fsdp2 too, where the sharded
    model, gathered, would show every rank the same mix of the ranks' shards: the digest is of
    what each rank built, before sharding."""
    args = [tiny_train_args(tiny_data, tmp_path / "run", run__sync=mode),
            tiny_train_args(tiny_data, tmp_path / "run", run__seed=2, run__sync=mode)]
    results = run_ranks(args, tmp_path / "logs", check=False)
    assert codes(results)[0] == [1, 1], codes(results)[1]
    assert results[0].stderr == (
        "ddpgpt: error: ranks disagree on the resolved config: rank 1 differs from rank 0; start "
        "every rank with the same command line and config file; and on the parameters before "
        "training: rank 1 differs from rank 0; every rank must build the model from the same "
        "seed (run.seed); do not seed ranks differently before init\n")
    assert results[1].stderr == ""
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_startup_check_catches_different_config(tiny_data, tmp_path):
    same, other = (tiny_train_args(tiny_data, tmp_path / "run"),
                   tiny_train_args(tiny_data, tmp_path / "run", optim__lr=0.02))
    results = run_ranks([same, other], tmp_path / "logs", check=False)
    assert codes(results)[0] == [1, 1], codes(results)[1]
    assert results[0].stderr == ("ddpgpt: error: ranks disagree on the resolved config: rank 1 "
                                 "differs from rank 0; start every rank with the same command "
                                 "line and config file\n")

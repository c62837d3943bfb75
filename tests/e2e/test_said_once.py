"""What a run says once: an input error the workers find at W=2 is one line (not one per rank,
nor followed by the elastic agent's own line on the failed worker), and a start that changed
what it resumed records each change once, even when it is killed and started again."""

import json

import numpy as np
import pytest

from ddpgpt.data.shards import HEADER_BYTES
from tests.helpers import tiny_train_args, write_dataset
from tests.in_process import run_in_process
from tests.processes import run_cli

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def test_bad_shards_on_two_ranks_at_w2_are_one_line(tmp_path):
    """Each rank hashes its own share of the shards (data.verify): with a changed shard in
    each share, both ranks fail, each with its own line; the lowest rank's is the one said."""
    rng = np.random.default_rng(0)
    data = write_dataset(tmp_path / "data", rng.integers(0, 256, 6000), rng.integers(0, 256, 900),
                         vocab_size=257, eot_id=256, shard_tokens=2000)
    for name in ("train_000000.bin", "train_000001.bin"):  # rank 0's share, and rank 1's
        shard = data / name
        raw = bytearray(shard.read_bytes())
        raw[HEADER_BYTES + 10] ^= 1
        shard.write_bytes(bytes(raw))
    r = run_in_process(*tiny_train_args(data, tmp_path / "run", steps=1)[2:], "--nproc", "2")
    assert r.returncode == 2 and r.stdout == "", r.stderr
    lines = r.stderr.splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith(f"ddpgpt: error: {data / 'train_000000.bin'}: sha256 mismatch "), \
        r.stderr


def test_a_start_killed_and_started_again_records_its_changes_once(tiny_data, tmp_path):
    """A mixture trained to its checkpoint at step 3, resumed with other weights (a
    mixture_change and a config_change at step 3), SIGKILLed after step 4, before its next
    checkpoint; the same command again resumes from step 3 and says the same: once each."""
    rng = np.random.default_rng(1)
    other = write_dataset(tmp_path / "other", rng.integers(0, 256, 6000),
                          rng.integers(0, 256, 900), vocab_size=257, eot_id=256)
    run = tmp_path / "run"

    def train(weight: float, steps: int, fault: str = ""):
        args = tiny_train_args(f"{tiny_data}:{weight},{other}:{1 - weight}", run, steps=steps)
        if fault:  # kill@4 ends the process that trains: one of its own
            return run_cli(*args[2:], env={"DDPGPT_FAULT": fault}, timeout=120)
        return run_in_process(*args[2:])

    assert train(0.5, 3).returncode == 0
    assert train(0.8, 6, fault="kill@4").returncode == -9
    r = train(0.8, 6)
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [(e["step"], e["event"]) for e in rows if "event" in e] == [
        (3, "mixture_change"), (3, "config_change")]
    assert [e["step"] for e in rows if "loss" in e] == list(range(1, 7))

"""Sharded, asynchronous checkpoints under faults: real multi-process runs through the command
line, faults injected at exact steps (DDPGPT_FAULT, ddpgpt/faults.py).

One run dir goes through a chain of runs, each resuming the previous one's checkpoints under
another sync mode and world size, each meeting one fault; the losses of the whole chain are the
straight run's (the plain-PyTorch oracle, one process):

    A  W=2 zero1   the write of step 2 held until the save of step 3 starts (that save waits);
                   rank 1 SIGKILLed during its write of step 4: step 3 is the newest checkpoint
    B  W=4 fsdp2   resumes from 3; rank 0 SIGKILLed in the commit of step 5, meta.json written,
                   before the rename: step 4 is the newest; `sample` reads it on one process
    C  W=1         resumes from 4; SIGTERM during the write of step 6: the stop waits for it and
                   writes step 7, exit 75
    D  W=2 ddp     step 7's rank-0 file corrupted: falls back to 6 with a warning naming the file,
                   and trains to the end

Plus a full disk on one rank only (its checkpoints on a tmpfs of its own), and the bytes a save
allocates on each rank against the bound (the rank's share + the largest tensor).
"""

from __future__ import annotations

import json
import re
import shutil
import sys

import numpy as np
import pytest
import torch

from ddpgpt.checkpoint import read, store
from ddpgpt.config.io import from_dict
from ddpgpt.data.tokenizer import load_tokenizer
from ddpgpt.guard.health import EXIT_PREEMPTED
from ddpgpt.model.gpt import GPT
from tests.dist.test_recovery_one_node import mount_namespace
from tests.helpers import (
    read_metrics,
    reference_training,
    save_format_2,
    saved_weights,
    tiny_train_args,
)
from tests.processes import Launch, codes, run_cli, run_ranks

pytestmark = [pytest.mark.dist, pytest.mark.timeout(420)]
STEPS = 10


def train(data, run_dir, world: int, sync: str = "ddp", fault: str | None = None) -> Launch:
    args = tiny_train_args(data, run_dir, STEPS, run__checkpoint_every=1,
                           run__keep_checkpoints=20, run__sync=sync)
    launch = ["--nproc", str(world)] if world > 1 else []
    return Launch([sys.executable, *args, *launch],
                  env={"DDPGPT_FAULT": fault} if fault else None)


def newest(run_dir) -> int:
    return store.find_latest(run_dir / "checkpoints")[1]["step"]


@pytest.fixture(scope="module")
def chain(tiny_data, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("chain") / "run"
    root, out = run_dir / "checkpoints", {}

    a = train(tiny_data, run_dir, 2, "zero1", "hold-save@2,kill-writing@4@1")
    out["A"] = (a.wait(240), a.text, newest(run_dir), sorted(p.name for p in root.iterdir()))

    b = train(tiny_data, run_dir, 4, "fsdp2", "kill-committing@5")
    out["B"] = (b.wait(240), b.text, newest(run_dir), sorted(p.name for p in root.iterdir()))
    out["B tmp"] = sorted(f.name for d in root.glob(".tmp-step_0000005-*") for f in d.iterdir())
    out["sample"] = run_cli("sample", "--run-dir", run_dir, "--prompt", "def ",
                            "--max-new-tokens", "8", "--top-k", "1", "--device", "cpu",
                            timeout=120)
    out["step 4"] = saved_weights(root / "step_0000004")

    c = train(tiny_data, run_dir, 1, fault="term-saving@6")
    out["C"] = (c.wait(240), c.text, newest(run_dir))

    shard = root / "step_0000007" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 1
    shard.write_bytes(bytes(data))
    d = train(tiny_data, run_dir, 2, "ddp")
    out["D"] = (d.wait(240), d.text, newest(run_dir))
    out["run_dir"] = run_dir
    return out


def test_the_next_save_waits_for_the_one_in_flight(chain):
    code, text, _, _ = chain["A"]
    assert "fault: hold-save holds the write of step 2" in text
    # released only when the save of step 3 waited for it (else held for 120 s: a timeout)
    assert "fault: released the write of step 2 at step 3" in text


def test_sigkill_during_an_async_write_leaves_the_previous_checkpoint(chain):
    code, text, step, listing = chain["A"]
    assert code != 0 and "fault: kill at step 4" in text, text
    assert step == 3
    assert [n for n in listing if n.startswith("step_")] == [f"step_{s:07d}" for s in (1, 2, 3)]
    assert any(n.startswith(".tmp-step_0000004-") for n in listing)  # never renamed


def test_sigkill_during_the_commit_leaves_the_previous_checkpoint(chain):
    code, text, step, listing = chain["B"]
    assert code != 0 and "fault: kill at step 5" in text, text
    assert f"resuming from {chain['run_dir'] / 'checkpoints' / 'step_0000003'} (step 3, saved " \
           "at world size 2)" in text
    assert not any(n.startswith(".tmp-step_0000004") for n in listing)  # removed at the start
    assert step == 4
    # everything was written, meta.json last: the rename is what publishes a checkpoint
    assert chain["B tmp"] == [".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp",
                              "__3_0.distcp", "meta.json", "trainer.pt"]


def test_a_checkpoint_written_at_w4_is_sampled_on_one_process(chain, tiny_data):
    """Its weights are the one-process oracle's of step 4, and `sample` (greedy) continues the
    prompt as a model holding the oracle's weights does."""
    result = chain["sample"]
    assert result.returncode == 0, result.stderr
    _, oracle = reference_training(tiny_data, STEPS, weights_at=4)
    for name, value in oracle.items():
        torch.testing.assert_close(chain["step 4"][name], value, rtol=0, atol=5e-5, msg=name)
    meta = store.read_meta(chain["run_dir"] / "checkpoints" / "step_0000004")
    model = GPT(from_dict(meta["config"]).model)
    model.load_state_dict(oracle)
    tok = load_tokenizer(tiny_data, json.loads((tiny_data / "meta.json").read_text())["tokenizer"])
    prompt = torch.tensor([tok.encode_batch(["def "])[0].tolist()])
    with torch.no_grad():
        out = model.eval().generate(prompt, 8, top_k=1, vocab_size=tok.vocab_size)
    assert result.stdout == tok.decode(out[0].tolist()) + "\n"


def test_a_stop_during_a_save_waits_for_it_and_its_own(chain):
    code, text, step = chain["C"]
    run_dir = chain["run_dir"]
    assert code == EXIT_PREEMPTED, text
    assert f"resuming from {run_dir / 'checkpoints' / 'step_0000004'} (step 4, saved at world " \
           "size 4)" in text
    assert "fault: term at step 6" in text and "released the write of step 6 at step 7" in text
    assert (f"ddpgpt: stopped: at step 7 on SIGTERM; checkpoint "
            f"{run_dir / 'checkpoints' / 'step_0000007'} is complete") in text
    assert step == 7 and store.read_meta(run_dir / "checkpoints" / "step_0000006")


def test_a_corrupt_shard_falls_back_with_a_warning_naming_it(chain):
    code, text, step = chain["D"]
    root = chain["run_dir"] / "checkpoints"
    assert code == 0, text
    warning = (f"ddpgpt: warning: skipping checkpoint: {root / 'step_0000007'}: __0_0.distcp "
               "does not match its sha256 in meta.json (corrupt); falling back to step_0000006")
    assert text.count(warning) == 1, text  # rank 0 says it; rank 1 falls back as quietly
    assert f"resuming from {root / 'step_0000006'} (step 6, saved at world size 1)" in text
    assert step == STEPS


def test_the_chain_trains_as_the_straight_run(chain, tiny_data):
    """Four runs, three modes, W = 2, 4, 1, 2, four faults: each step once in metrics.jsonl,
    every loss and the final weights within float tolerance of one plain-PyTorch process."""
    losses, weights = reference_training(tiny_data, STEPS)
    rows = read_metrics(chain["run_dir"])[0]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    np.testing.assert_allclose([r["loss"] for r in rows], losses, rtol=2e-5)
    final = saved_weights(chain["run_dir"] / "checkpoints" / f"step_{STEPS:07d}")
    for name, value in weights.items():
        torch.testing.assert_close(final[name], value, rtol=0, atol=1e-4, msg=name)
    assert "Traceback" not in "".join(chain[k][1] for k in "ABCD")


def test_a_format_2_checkpoint_resumes_under_fsdp2(chain, tiny_data, tmp_path):
    """The chain's step 6, rewritten as the previous store wrote it (whole, model.safetensors +
    trainer.pt), resumed at W=2 under fsdp2 (whose load scatters each tensor from rank 0, so
    every rank must list them in the same order): the straight run's losses, and format 3 after
    it."""
    run_dir = tmp_path / "run"
    shutil.copytree(chain["run_dir"], run_dir)
    root = run_dir / "checkpoints"
    for path in root.iterdir():
        if path.name > "step_0000006":
            shutil.rmtree(path)
    meta = store.read_meta(root / "step_0000006")
    state = read.load(root / "step_0000006", meta)
    shutil.rmtree(root / "step_0000006")
    save_format_2(root, 6, state, {k: v for k, v in meta.items()
                                   if k not in ("files", "format_version", "step")})
    job = train(tiny_data, run_dir, 2, "fsdp2")
    assert job.wait(240) == 0, job.text
    assert f"resuming from {root / 'step_0000006'} (step 6, saved at world size 1)" in job.text
    losses, _ = reference_training(tiny_data, STEPS)
    rows = read_metrics(run_dir)[0]
    np.testing.assert_allclose([r["loss"] for r in rows], losses, rtol=2e-5)
    assert store.read_meta(root / f"step_{STEPS:07d}")["format_version"] == 3


def test_a_full_disk_on_one_rank_stops_every_rank(tiny_data, tmp_path):
    """Rank 1's checkpoints on a 64 KB tmpfs of its own (a node whose disk is full): its write
    fails; every rank stops at the same step, rank 0 saying why in one line that names rank 1;
    no temporary directory is left in either rank's view."""
    prefix = mount_namespace()
    if prefix is None:
        pytest.skip("cannot mount a tmpfs here (needs root or user namespaces)")
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    listing = tmp_path / "rank1-listing"
    mount = [*prefix, "sh", "-c", 'mount -t tmpfs -o size=64k tmpfs "$0" && "$@"; code=$?; '
             f'ls -A "$0" > {listing}; exit $code', str(run_dir / "checkpoints")]
    args = tiny_train_args(tiny_data, run_dir, STEPS, run__checkpoint_every=1)
    ranks = run_ranks([args] * 2, tmp_path / "logs", check=False, prefixes=[[], mount])
    assert codes(ranks)[0] == [1, 1], codes(ranks)[1]
    line = ranks[0].stderr.splitlines()[-1]
    step = int(re.match(r"ddpgpt: error: step (\d+): ", line).group(1))
    assert line == (
        f"ddpgpt: error: step {step}: cannot write checkpoint "
        f"{run_dir / 'checkpoints' / f'step_{step:07d}'}: No space left on device (ENOSPC) on "
        "rank 1; its temporary files were removed. The last complete checkpoint (none yet) is "
        "intact: free space, then run the same command with --reset to start over")
    assert "error" not in ranks[1].stderr and "Traceback" not in ranks[0].stderr + ranks[1].stderr
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == []
    assert listing.read_text() == ""


def test_a_save_allocates_at_most_its_share_and_the_largest_tensor(tiny_data, tmp_path):
    """W=2, every mode with AdamW, zero1 and fsdp2 with Muon: each rank writes about half of the
    checkpoint (every byte once in all), and a save, written in the step or staged for the
    background, allocates no more than that share plus the largest tensor (+ 64 KB for DCP's
    plans): no rank gathers the state."""
    cases = [[m, "adamw"] for m in ("ddp", "allreduce", "rs-ag", "zero1", "fsdp2")]
    cases += [["zero1", "muon"], ["fsdp2", "muon"]]
    out = tmp_path / "out.json"
    run_ranks([["-m", "tests.dist.workers_checkpoint", "checkpoint_memory",
                json.dumps({"data": str(tiny_data), "run_dir": str(tmp_path), "cases": cases}),
                str(out)]] * 2, tmp_path / "logs", timeout=240)
    for case, per_rank in json.loads(out.read_text()).items():
        ranks = [json.loads(r) for r in per_rank]
        total, largest = ranks[0]["total"], ranks[0]["largest"]
        assert sum(r["written"] for r in ranks) == total, case
        for r in ranks:
            bound = total / 2 + largest
            assert r["written"] <= bound, (case, r)
            assert r["staged"] == r["written"], (case, r)
            assert r["written"] <= r["peak_staged"] <= r["written"] + 64 * 1024, (case, r)
            assert r["peak_sync"] <= bound + 64 * 1024, (case, r)
        if case == "fsdp2 adamw":  # the count sees a gather: the state, whole, on every rank
            assert all(r["peak_gather"] >= 0.9 * total for r in ranks), ranks
        print(f"\n[figure] {case}: total {total / 1e3:.0f} kB, largest {largest / 1e3:.0f} kB; "
              + "; ".join(f"rank {i} writes {r['written'] / 1e3:.0f} kB, allocates "
                          f"{r['peak_sync'] / 1e3:.0f} kB (in the step) / "
                          f"{r['peak_staged'] / 1e3:.0f} kB (staged), gathering it "
                          f"{r['peak_gather'] / 1e3:.0f} kB"
                          for i, r in enumerate(ranks)))


def test_a_failure_on_one_rank_is_the_same_line_on_every_rank(tmp_path):
    """Straight through the Saver at W=2: rank 1 out of memory while it copies its share (before
    any of the save's collectives: else rank 0 would go on into DCP's and fail later, elsewhere);
    rank 1's disk full with run.checkpoint_async off (the OS's reason, not torch's "unexpected
    pos"); rank 0 unable to prune after publishing (a warning: rank 1 must not wait for an
    outcome that never comes). Each: every rank at once, nothing left behind."""
    out = tmp_path / "out.json"
    run_ranks([["-m", "tests.dist.workers_checkpoint", "saver_failures",
                json.dumps({"root": str(tmp_path / "runs")}), str(out)]] * 2,
              tmp_path / "logs", timeout=150)
    result = {case: [json.loads(r) for r in ranks] for case, ranks in
              json.loads(out.read_text()).items()}
    stage = [outcome for outcome, _, _ in result["stage"]]
    assert stage[0] == stage[1] and stage[0].startswith(
        "SaveFailed: cannot copy checkpoint "), stage
    assert stage[0].endswith("step_0000001 to memory: RuntimeError: DefaultCPUAllocator: can't "
                             "allocate memory: you tried to allocate 1000 bytes on rank 1"), stage
    assert all(listing == [] and took < 20 for _, listing, took in result["stage"]), result
    enospc = [outcome for outcome, _, _ in result["sync-enospc"]]
    assert enospc[0] == enospc[1] and enospc[0].endswith(
        "No space left on device (ENOSPC) on rank 1; its temporary files were removed"), enospc
    assert all(listing == [] for _, listing, _ in result["sync-enospc"]), result
    assert [(outcome, listing) for outcome, listing, _ in result["prune"]] == \
        [("saved", ["step_0000001"])] * 2, result
    assert all(took < 20 for _, _, took in result["prune"]), result

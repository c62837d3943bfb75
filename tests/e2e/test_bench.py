"""`ddpgpt bench`: every sync mode measured on 2 processes, a table, bench.json and the chart."""

import json
import sys

import pytest

from ddpgpt.commands import bench
from ddpgpt.sync.modes import MODES
from tests.in_process import run_in_process

pytestmark = [pytest.mark.e2e, pytest.mark.dist, pytest.mark.timeout(240)]


# GPT-2's architecture: the byte counts below are its matrices'
SMALL = ("[model]\narch = \"gpt2\"\nn_layer = 2\nn_head = 2\nn_embd = 32\nblock_size = 32\n"
         "[data]\nmicro_batch = 2\nglobal_batch = 8\n")


def test_bench_measures_every_mode(tiny_data, tmp_path):
    (tmp_path / "small.toml").write_text(SMALL)
    r = run_in_process("bench", "--nproc", "2", "--data", tiny_data, "--config",
                       tmp_path / "small.toml", "--steps", "3", "--warmup", "1", "--out",
                       tmp_path / "out")
    assert r.returncode == 0, r.stderr
    result = json.loads((tmp_path / "out" / "bench.json").read_text())
    rows = {row["mode"]: row for row in result["rows"]}
    assert list(rows) == ["no sync", *MODES] and result["world_size"] == 2
    assert [row["runs_as"] for row in rows.values()] == [
        "Sync", "DDPSync", "BucketSync", "BucketSync", "Zero1Sync", "FSDP2Sync"]
    assert all(row["step_s"] > 0 and row["exposed_s"] >= 0 for row in rows.values())
    N = rows["ddp"]["params"]
    # A ring all-reduce sends (W-1)/W of the gradients twice: N fp32 values per rank at W=2.
    assert rows["ddp"]["sent_bytes"] == rows["allreduce"]["sent_bytes"] == 4 * N
    full, zero1, fsdp2 = rows["ddp"]["memory"], rows["zero1"]["memory"], rows["fsdp2"]["memory"]
    assert full["state"] == 2 * 4 * N  # AdamW's two fp32 moments
    assert abs(zero1["state"] - full["state"] / 2) <= 4 * 2 * 2 * 16  # half, but for bucket padding
    assert abs(sum(fsdp2.values()) - sum(full.values()) / 2) <= 0.1 * sum(full.values())
    assert (tmp_path / "out" / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "fsdp2" in r.stdout and "exposed ms" in r.stdout


def test_bench_with_muon_holds_half_of_its_state_per_rank(tiny_data, tmp_path):
    """--optim muon at W=2: every mode steps Muon, each rank keeps the momentum of its own
    matrices only (the 8 matrices of this model split 4 and 4, the same cost: exactly half), and
    zero1 sends no more than ddp's gradient bytes (its matrices whole in its own buckets)."""
    (tmp_path / "small.toml").write_text(SMALL)
    r = run_in_process("bench", "--nproc", "2", "--data", tiny_data, "--config",
                       tmp_path / "small.toml", "--optim", "muon", "--steps", "2", "--warmup", "0",
                       "--out", tmp_path / "out")
    assert r.returncode == 0, r.stderr
    result = json.loads((tmp_path / "out" / "bench.json").read_text())
    rows = {row["mode"]: row for row in result["rows"]}
    assert result["muon"] and list(rows) == ["no sync", *MODES]
    matrices = 2 * (3 * 32 * 32 + 32 * 32 + 4 * 32 * 32 + 4 * 32 * 32)  # 2 blocks
    for mode, row in rows.items():
        assert row["memory"]["muon_state"] == 4 * matrices / 2, mode  # fp32, half each
    N = rows["ddp"]["params"]
    assert rows["ddp"]["sent_bytes"] == 4 * N + 4 * matrices / 2  # + the owners' matrices
    assert rows["zero1"]["sent_bytes"] <= 4 * N + 2 * 4 * 4 * 16  # ddp's, but for AdamW's padding
    assert "of which Muon MB" in r.stdout


def test_one_rank_group_runs_each_mode_for_real(tiny_data, tmp_path):
    """--group at world size 1: a one-rank gloo group, and each mode's own code (DDP, the
    buckets, zero1's shards), as a single GPU measures them under NCCL; rounds take turns."""
    (tmp_path / "small.toml").write_text(SMALL)
    r = run_in_process("bench", "--group", "--data", tiny_data, "--config",
                       tmp_path / "small.toml", "--sync", "ddp,rs-ag,zero1", "--steps", "2",
                       "--warmup", "0", "--repeats", "2", "--device", "cpu", "--out",
                       tmp_path / "out")
    assert r.returncode == 0, r.stderr
    result = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert (result["world_size"], result["backend"], result["repeats"]) == (1, "gloo", 2)
    rows = {row["mode"]: row for row in result["rows"]}
    assert [row["runs_as"] for row in rows.values()] == [
        "Sync", "DDPSync", "BucketSync", "Zero1Sync"]
    assert all(row["sent_bytes"] == 0 for row in rows.values())  # (W-1)/W of anything
    assert rows["zero1"]["memory"]["state"] == rows["ddp"]["memory"]["state"]  # 1/W of it
    assert "medians of 4 steps in 2 rounds" in r.stdout


def test_no_chart_without_matplotlib(tmp_path, monkeypatch):
    """matplotlib is an optional extra: without it bench writes its table and JSON only."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails as if not installed
    row = {"mode": "ddp", "step_s": 1.0, "exposed_s": 0.1, "memory": {"params": 1}}
    assert bench.plot([row], tmp_path / "bench.png", "test") is None
    assert not (tmp_path / "bench.png").exists()


@pytest.mark.parametrize("case", ["proc", "file", "below a file"])
def test_an_unwritable_out_is_one_line_before_measuring(case, tiny_data, tmp_path):
    """Checked first: the results of minutes of measuring are never lost to a bad --out."""
    (tmp_path / "file").write_text("x")
    out = {"proc": "/proc/ddpgpt-bench", "file": tmp_path / "file",
           "below a file": tmp_path / "file" / "out"}[case]
    r = run_in_process("bench", "--data", tiny_data, "--device", "cpu", "--out", out)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith(f"ddpgpt: error: --out {out}: cannot write there: ")
    assert r.stderr.endswith("; give a directory you can write to\n")
    assert len(r.stderr.splitlines()) == 1 and "measuring" not in r.stderr


def test_bad_input_under_nproc_is_one_line_from_the_launcher(tiny_data, tmp_path):
    """Checked once by the launcher, before any worker starts: not one line per rank plus the
    elastic agent's."""
    (tmp_path / "odd.toml").write_text(SMALL.replace("global_batch = 8", "global_batch = 6"))
    r = run_in_process("bench", "--nproc", "2", "--data", tiny_data, "--config",
                       tmp_path / "odd.toml", "--out", tmp_path / "out")
    assert r.returncode == 2, r.stderr
    assert r.stderr == ("ddpgpt: error: data.global_batch = 6 is not divisible by world size 2 × "
                        "data.micro_batch 2 = 4; make the global batch a multiple of 4 or change "
                        "the micro-batch\n")


def test_a_signal_keeps_what_was_measured(tiny_data, tmp_path):
    """SIGINT to the launcher: the workers finish the mode being measured, rank 0 prints the
    table of the modes measured and writes them, one line says so; exit 128 + 2. Nothing is
    left behind (no temporary run dirs)."""
    import signal

    from tests.processes import Launch

    (tmp_path / "small.toml").write_text(SMALL)
    job = Launch([sys.executable, "-m", "ddpgpt", "bench", "--nproc", "2", "--data", tiny_data,
                  "--config", tmp_path / "small.toml", "--sync", "ddp,zero1,fsdp2", "--steps",
                  "40", "--warmup", "0", "--out", tmp_path / "out"], cwd=tmp_path)
    job.wait_for("ddpgpt bench: measuring 4 modes", timeout=60)
    job.proc.send_signal(signal.SIGINT)
    assert job.wait(120) == 130, job.text
    result = json.loads((tmp_path / "out" / "bench.json").read_text())
    measured = [row["mode"] for row in result["rows"]]
    assert result["stopped_by"] == "SIGINT" and measured == ["no sync", "ddp", "zero1",
                                                              "fsdp2"][:len(measured)]
    assert 1 <= len(measured) < 4, job.text
    lines = [line for line in job.text.splitlines() if line.startswith("ddpgpt:")]
    assert lines == [f"ddpgpt: stopped: bench stopped by SIGINT after measuring {len(measured)} "
                     f"of 4 modes; the table above and {tmp_path / 'out' / 'bench.json'} hold "
                     "them"], job.text
    assert "interrupted" not in job.text and "closing signal" not in job.text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "small.toml"]

"""`ddpgpt check` end to end on the CPU: rows at W=1 (a group of one) and W=2 (the workers it
starts), and command rows that run `ddpgpt train/sample` as a user does. The full matrix's rows
are the same code with other cases (tests/unit/test_check.py checks the plan)."""

import json
import re

import pytest

from tests.processes import run_cli

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(620)]  # hang guards: 97 s at load 3

# One row of each kind the matrix has (the rest are the same code with other cases)
TRAINING = ["zero1 · muon · bf16", "ddp · adamw · fp16 · loss scaler · step 3 forced non-finite",
            "allreduce · adamw · fp32 · grad-compress bf16", "speed zero1",
            "fsdp2 · muon · fp32 · modern"]
COMMANDS = ["loader copy", "checkpoint cpu → cpu", "SIGTERM → exit 75 → resume", "eval", "sample",
            "export"]
# FlexAttention's rows: trained through it (its backward on a CPU is model/flex_cpu.py's); the
# speed row, a GPU kernel's goal, listed and not run on a CPU
FLEX = ["ddp · adamw · fp32 · documents · flex",
        "speed flex · T=1024 · documents ~1000 · against causal"]


def test_check_compares_rows_at_one_and_two_processes_and_the_commands(tmp_path, tiny_data):
    out = tmp_path / "out"
    r = run_cli("check", "--device", "cpu", "--quick", "--out", out, "--data", tiny_data,
                "--only", ",".join(TRAINING + COMMANDS + FLEX), timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    data = json.loads((out / "device-check.json").read_text())
    rows = {(row["check"], row["world"]): row for row in data["rows"]}
    assert set(rows) == ({(c, w) for c in TRAINING + FLEX[:1] for w in (1, 2)}
                         | {(c, 1) for c in COMMANDS + FLEX[1:]})
    flex = [rows.pop((FLEX[1], 1))]
    assert (flex[0]["status"], flex[0]["figure"]) == (
        "not run", "needs CUDA (its goal is a GPU kernel's, not cpu's)")
    assert {row["status"] for row in rows.values()} == {"pass"}
    assert rows[TRAINING[0], 2]["oracle"] == "ddp, cpu, W=2"
    assert rows[TRAINING[1], 1]["figure"].endswith("step 3 skipped, weights unchanged")
    assert rows["SIGTERM → exit 75 → resume", 1]["figure"] == (
        "stopped at step 3, exit 75; losses max abs Δ 0.0e+00, final weights bitwise equal")
    # greedy with the KV cache against the whole context's: the same tokens, or a tie within
    # fp32's rounding where they part (the products round otherwise; the row's own rule)
    assert re.fullmatch(r"24 tokens equal|parts at token \d+ of 24, where the two best fp32 "
                        r"logits are \S+ apart \(a tie within 0\.0001\)",
                        rows["sample", 1]["figure"]), rows["sample", 1]["figure"]
    # zero1 against ddp at W=2: another reduction order, so within the stated tolerance, not
    # bitwise (9.7e-08 on an AMD EPYC, 0 on the Intel VM these docs come from)
    speed = re.fullmatch(r"[\d,]+ tokens/s; max rel Δ loss (\S+) \(≤ 1e-05\)",
                         rows["speed zero1", 2]["figure"])
    assert speed and float(speed.group(1)) <= 1e-5, rows["speed zero1", 2]["figure"]
    assert data["environment"]["torch"] and data["environment"]["device"] == "cpu"
    # what is printed is what is written
    table = (out / "device-check.md").read_text().split("\n\n")[2]
    assert table in r.stdout and table.count("\n") == len(rows) + len(flex) + 1


def test_check_refuses_a_missing_cuda_in_one_line(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is here")
    r = run_cli("check", "--device", "cuda", "--out", tmp_path)
    assert r.returncode == 2 and r.stderr.startswith("ddpgpt: error: check --device cuda: no CUDA "
                                                     "device is visible to torch")
    assert len(r.stderr.strip().splitlines()) == 1 and not list(tmp_path.iterdir())


def test_check_refuses_data_that_is_not_a_dataset_in_one_line(tmp_path):
    r = run_cli("check", "--device", "cpu", "--out", tmp_path / "out", "--data", tmp_path / "none")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert r.stderr.startswith(f"ddpgpt: error: dataset {tmp_path / 'none'} does not exist; "
                               "create it with: ddpgpt prepare --out")
    assert not (tmp_path / "out" / "device-check.md").exists()

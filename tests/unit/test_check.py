"""`ddpgpt check`'s plan and verdicts: every mode, precision and optimizer has a row against an
oracle; a row passes only within its tolerance; what the device lacks is "not run", never a pass."""

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch

from ddpgpt.commands.check import main as check
from ddpgpt.commands.check import matrix, training
from ddpgpt.commands.check.matrix import Case
from ddpgpt.commands.check.report import FAIL, NOT_RUN, PASS, Row, write
from ddpgpt.commands.check.training import Result
from ddpgpt.config.commands import CheckConfig
from ddpgpt.distributed.group import DistEnv
from ddpgpt.sync.modes import MODES


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("world", [1, 2])
def test_the_plan_has_every_mode_precision_and_optimizer_against_an_oracle(device, world):
    specs = matrix.plan(device, world, quick=False)
    names = {s.check for s in specs}
    for mode, row in MODES.items():
        for precision in ("fp32", "bf16"):
            for optim in ("adamw", "muon"):
                assert f"{mode} · {optim} · {precision}" in names
            assert f"{mode} · adamw · {precision} · compile" in names
        assert (f"{mode} · adamw · fp32 · grad-compress bf16" in names) == row.compression
        assert any(n.startswith(f"{mode} · adamw · fp16 · loss scaler") for n in names) == \
            row.loss_scaler
        assert {f"speed {mode}", f"peak memory {mode}"} <= names
        assert f"{mode} · muon · fp32 · modern" in names  # the modern arch, every mode
    assert {"ddp · muon · bf16 · modern", "ddp · muon · fp16 · modern",
            "ddp · muon · fp32 · compile · modern"} <= names
    assert len(names) == len(specs) and not any("," in n for n in names)  # --only splits at ","
    for s in specs:
        assert s.oracle != s.case and s.against
        assert s.oracle is None or s.oracle.arch == s.case.arch  # one arch per row
        assert s.oracle is not None or s.check == "peak memory ddp"  # against the mode table
        # ddp against the fp32 CPU run, the other modes against ddp on the same device
        # fp16 against the fp32 CPU run with the same step skipped
        if s.case.skip_at:
            assert s.oracle == Case(None, skip_at=s.case.skip_at)
        elif (s.kind == "losses" and not s.case.compile and s.case.compress == "none"
                and not s.case.torch_hook and s.case.attention == "sdpa"):
            assert s.oracle.mode == (None if s.case.mode == "ddp" else "ddp")
    # every run the rows read is run once, the oracles too
    assert set(matrix.cases(specs)) == {c for s in specs for c in (s.case, s.oracle) if c}


def test_quick_compiles_once():
    for world in (1, 2):
        compiled = [s.check for s in matrix.plan("cpu", world, quick=True) if s.case.compile]
        assert compiled == (["ddp · adamw · fp32 · compile"] if world == 1 else [])


def _spec(check):
    return next(s for s in matrix.plan("cpu", 2, quick=False) if s.check == check)


def _results(spec, got, want, **fields):
    return {spec.case: Result(losses=got, **fields), spec.oracle: Result(losses=want)}


def test_a_row_passes_within_its_tolerance_and_fails_beyond_it():
    spec = _spec("zero1 · adamw · fp32")
    want = [5.0, 4.0, 3.0]
    ok = training.row(spec, _results(spec, [5.0, 4.0 * (1 + 5e-6), 3.0], want), "cpu", 2)
    assert ok.status == PASS and ok.figure == "max rel Δ loss 5.0e-06 (≤ 1e-05)"
    bad = training.row(spec, _results(spec, [5.0, 4.0 * (1 + 2e-5), 3.0], want), "cpu", 2)
    assert bad.status == FAIL and bad.figure == "max rel Δ loss 2.0e-05 (≤ 1e-05)"
    nan = training.row(spec, _results(spec, [5.0, float("nan"), 3.0], want), "cpu", 2)
    short = training.row(spec, _results(spec, [5.0], want), "cpu", 2)
    assert nan.status == short.status == FAIL
    assert (ok.check, ok.device, ok.world, ok.oracle) == ("zero1 · adamw · fp32", "cpu", 2,
                                                         "ddp, cpu, W=2")


def test_a_run_that_raised_fails_its_row_and_its_oracle_s_rows_with_the_error():
    spec = _spec("fsdp2 · muon · bf16")
    results = {spec.case: Result(error="RuntimeError: boom (fsdp2.py:12)"),
               spec.oracle: Result(losses=[1.0])}
    assert training.row(spec, results, "cpu", 2).figure == "RuntimeError: boom (fsdp2.py:12)"
    results = {spec.case: Result(losses=[1.0]), spec.oracle: Result(error="ValueError: x")}
    r = training.row(spec, results, "cpu", 2)
    assert r.status == FAIL and r.figure == "its oracle: ValueError: x"


def test_fp16_fails_when_the_forced_non_finite_step_was_not_skipped():
    spec = _spec(f"ddp · adamw · fp16 · loss scaler · step {matrix.SKIP_AT} forced non-finite")
    assert spec.oracle == Case(None, skip_at=matrix.SKIP_AT)
    losses = [5.0, 4.0, 3.0]
    done = training.row(spec, _results(spec, losses, losses, skipped=True), "cpu", 2)
    assert done.status == PASS and done.figure.endswith("step 3 skipped, weights unchanged")
    missed = training.row(spec, _results(spec, losses, losses, skipped=False), "cpu", 2)
    assert missed.status == FAIL and missed.figure.endswith("step 3 was NOT skipped")


def test_memory_needs_cuda_holds_the_tables_bytes_and_sharded_modes_less_than_ddp():
    spec = _spec("peak memory zero1")
    results = _results(spec, [1.0], [1.0])
    cpu = training.row(spec, results, "cpu", 2)
    assert (cpu.status, cpu.figure) == (NOT_RUN, "needs CUDA memory statistics")
    results[spec.case].floor_bytes = 50 * 2**20
    results[spec.case].peak_bytes, results[spec.oracle].peak_bytes = 90 * 2**20, 100 * 2**20
    assert training.row(spec, results, "cuda", 2).status == PASS
    results[spec.case].peak_bytes = 110 * 2**20
    r = training.row(spec, results, "cuda", 2)
    assert r.status == FAIL and r.figure == "110 MiB (table ≥ 50; ddp 100, so ≤ 100)"
    results[spec.case].peak_bytes = 40 * 2**20  # less than the state itself: not measured right
    assert training.row(spec, results, "cuda", 2).status == FAIL
    ddp = _spec("peak memory ddp")
    assert ddp.oracle is None
    alone = training.row(ddp, {ddp.case: Result(peak_bytes=60 * 2**20, floor_bytes=50 * 2**20)},
                         "cuda", 2)
    assert alone.status == PASS and alone.figure == "60 MiB (table ≥ 50)"


def test_speed_ddp_is_checked_against_the_fp32_cpu_run_s_first_loss():
    spec = _spec("speed ddp")
    assert spec.oracle == Case(None, speed=True)
    results = {spec.case: Result(losses=[5.0, 9.0], tokens_per_s=1234.4),
               spec.oracle: Result(losses=[5.0])}
    r = training.row(spec, results, "cpu", 2)
    assert r.status == PASS and r.figure == "1,234 tokens/s; max rel Δ loss 0.0e+00 (≤ 1e-05)"


def test_rows_a_machine_cannot_run_say_what_they_need():
    specs = matrix.plan("cuda", 2, quick=True)
    rows = training.not_run(specs, "cuda", 2, "a second GPU")
    assert {(r.status, r.figure) for r in rows} == {(NOT_RUN, "needs a second GPU")}
    hook = _spec("ddp · adamw · fp32 · torch's bf16_compress_hook")
    assert hook.oracle == Case("ddp", compress="bf16")
    env = DistEnv()  # no group, so no NCCL
    assert training.train(hook.case, env, "unused", 2, True).needs == "NCCL"
    r = training.row(hook, {hook.case: Result(needs="NCCL"), hook.oracle: Result(losses=[1.0])},
                     "cpu", 2)
    assert (r.status, r.figure) == (NOT_RUN, "needs NCCL")


def test_only_selects_rows_by_pattern():
    cfg = CheckConfig(only="fsdp2 · *, SIGTERM*")
    picked = [s.check for s in check.plan(cfg, "cpu", 2)]
    assert picked and all(c.startswith("fsdp2 · ") for c in picked)
    assert check.selected(cfg, "SIGTERM → exit 75 → resume") and not check.selected(cfg, "eval")
    assert check.selected(CheckConfig(), "anything")


def test_the_report_is_one_table_and_the_same_rows_as_json(tmp_path):
    rows = [Row("ddp · adamw · fp32", "cpu", 1, "the fp32 CPU run", "max rel Δ loss 0.0e+00",
                PASS),
            Row.needs("peak memory ddp", "cpu", 1, "ddp's peak", "CUDA memory statistics")]
    env = {"ddpgpt": "0", "python": "3", "torch": "2.13.0", "cpu": "x, 2 usable cores",
           "device": "cpu", "cuda": "none", "nccl": "none", "driver": "none"}
    spent = {"seconds": 12.3, "cpu_seconds": 20.5, "load": 3.25}
    md, js = write(tmp_path, env, rows, "quick subset", spent)
    text = md.read_text()
    assert "| ddp · adamw · fp32 | cpu | 1 | the fp32 CPU run | max rel Δ loss 0.0e+00 | pass |" \
        in text
    assert "| peak memory ddp | cpu | 1 | ddp's peak | needs CUDA memory statistics | not run |" \
        in text
    assert "torch 2.13.0, CUDA none, NCCL none, driver none" in text
    assert "1 passed, 0 failed, 1 not run, of 2 rows; 12 s (20 s of CPU time; a load of 3.2 at " \
           "the end)" in text  # on a shared machine the wall time says little alone
    data = json.loads(js.read_text())
    assert [Row(**r) for r in data["rows"]] == rows and data["scope"] == "quick subset"
    assert {k: data[k] for k in spent} == spent
    (tmp_path / "pipe").mkdir()
    pipe = write(tmp_path / "pipe", env, [Row("x", "cpu", 1, "a|b", "y", PASS)], "", spent)
    assert "| x | cpu | 1 | a\\|b | y | pass |" in pipe[0].read_text()  # a cell's pipe: no column


def test_check_exits_non_zero_when_a_row_fails(tmp_path, monkeypatch, tiny_data):
    """The whole story, with every row but one command row deselected: its failure is the exit."""
    failing = Row("export", "cpu", 1, "the fp32 CPU model's logits", "boom", FAIL)
    monkeypatch.setattr(check.commands, "rows", lambda *a: [failing])
    cfg = CheckConfig(device="cpu", out=str(tmp_path), data=str(tiny_data), only="export")
    with pytest.raises(check.CheckFailed, match=r"^1 of 1 rows failed \(export\); see "):
        check.run(cfg)
    assert json.loads((tmp_path / "device-check.json").read_text())["rows"][0]["status"] == FAIL


def test_export_without_transformers_is_not_run_and_says_what_it_needs(tmp_path, monkeypatch):
    from ddpgpt.commands.check import commands

    monkeypatch.setattr(commands.importlib.util, "find_spec", lambda name: None)
    r = commands.export_row(tmp_path, tmp_path, "cpu")
    assert (r.status, r.figure) == (NOT_RUN, "needs transformers (pip install 'ddpgpt[export]')")


@pytest.mark.parametrize("argv, line", [
    (["--device", "tpu"], "ddpgpt: error: invalid config: check.device = 'tpu'"),
    (["--nproc", "-1"], "ddpgpt: error: invalid config: --nproc -1 must be >= 0 (0: auto)"),
])
def test_bad_flags_are_one_line(argv, line, capsys, tmp_path):
    from ddpgpt.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["check", "--out", str(tmp_path / "out"), *argv])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith(line) and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()


def test_no_compile_lists_the_compile_rows_as_left_out(tiny_data):
    cfg = CheckConfig(device="cpu", only="ddp · adamw · fp32,ddp · adamw · fp32 · compile",
                      compile=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a small model: a second thread only waits on a busy machine
    try:
        rows = check.training_rows(cfg, DistEnv(), str(tiny_data), 2, None)
    finally:
        torch.set_num_threads(threads)
    by_check = {r.check: r for r in rows}
    assert set(by_check) == {"ddp · adamw · fp32", "ddp · adamw · fp32 · compile"}
    assert by_check["ddp · adamw · fp32"].status == PASS
    compiled = by_check["ddp · adamw · fp32 · compile"]
    assert (compiled.status, compiled.figure) == (NOT_RUN, "left out by --no-compile")


# ---- FlexAttention's rows -----------------------------------------------------------------------

def test_flex_rows_are_planned_and_the_speed_row_runs_on_cuda_only():
    from ddpgpt.commands.check import attention
    from ddpgpt.model import flex

    for device in ("cpu", "cuda"):
        for world in (1, 2):
            flexed = [s for s in matrix.plan(device, world, quick=True)
                      if s.case.attention == "flex"]
            assert [s.check for s in flexed] == [
                "ddp · adamw · fp32 · documents · flex", "ddp · adamw · bf16 · documents · flex",
                "ddp · muon · fp32 · modern · documents · flex"]
            assert all(s.oracle == dataclasses.replace(s.case, attention="sdpa")
                       and s.case.align == "bos" for s in flexed)
    if flex.unavailable():
        pytest.skip("this torch has no FlexAttention")
    rows = {r.check: r for r in attention.rows("cpu", lambda name: name == attention.SPEED,
                                                None)}
    assert [(r.status, r.figure) for r in rows.values()] == [
        (NOT_RUN, "needs CUDA (its goal is a GPU kernel's, not cpu's)")]
    case = _spec("ddp · adamw · fp32 · documents · flex").case
    assert training.lacking("cpu") == "" and case.attention == "flex"


def _dense_attend(q, k, v, mask, gqa):
    """FlexAttention's numbers by SDPA: its block mask's mask_mod evaluated at every (i, j)."""
    from torch.nn.attention.flex_attention import create_mask

    allowed = create_mask(mask.mask_mod, mask.shape[0], 1, q.size(2), k.size(2), q.device)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed,
                                                            enable_gqa=gqa)


def test_the_flex_rows_pass_on_its_numbers_and_fail_on_others(monkeypatch):
    """The rows' own arithmetic, on a CPU: FlexAttention stood in for by what it must compute (the
    rows pass), then by causal attention that ignores the documents (they fail)."""
    from ddpgpt.commands.check import attention
    from ddpgpt.model import flex

    monkeypatch.setattr(attention, "lacking", lambda device: "")
    monkeypatch.setattr(attention, "MODELS", {  # smaller, the same pieces: a CPU's time
        name: (dataclasses.replace(cfg, n_embd=32, block_size=160, vocab_size=64), window // 4)
        for name, (cfg, window) in attention.MODELS.items()})
    monkeypatch.setattr(attention, "SPEED_SHAPE", (2, 256, 64, 2))
    monkeypatch.setattr(attention, "SPEED_STEPS", (1, 3))
    monkeypatch.setattr(flex, "attend", _dense_attend)
    said = []
    rows = {r.check: r for r in attention.rows("cpu", lambda name: True, said.append)}
    assert len(said) == 2 and len(rows) == 3
    for name in attention.MODELS:
        assert rows[name].status == PASS, rows[name]
        assert rows[name].figure.startswith("max rel Δ logits and gradients ")
    assert rows[attention.SPEED].status == NOT_RUN  # a GPU's goal
    speed = attention.speed("cpu").figure
    assert re.fullmatch(r"flex \d+\.\d\d× causal \(\d+\.\d\d vs \d+\.\d\d ms\), dense mask "
                        r"\d+\.\d\d× \(goal ≤ 1\.2×\)", speed), speed
    monkeypatch.setattr(flex, "attend", lambda q, k, v, mask, gqa:
                        torch.nn.functional.scaled_dot_product_attention(
                            q, k, v, is_causal=True, enable_gqa=gqa))
    for name in attention.MODELS:
        row = attention.same(name, "cpu")
        assert row.status == FAIL and float(row.figure.split()[6]) > 1e-3, row


def test_its_own_data_is_one_line_not_prepares_report_and_advice(tmp_path, capsys):
    """check makes a dataset of 14 standard-library modules: prepare's summary and its warning
    about a val split of 3 documents are about data the user never asked for."""
    path = check.prepare_data(tmp_path / "data")
    out, err = capsys.readouterr()
    assert (out, err) == ("", f"ddpgpt check: its data: {len(check.CORPUS)} standard-library "
                              f"modules as bytes, in {tmp_path / 'data'}\n")
    assert json.loads((tmp_path / "data" / "meta.json").read_text())["tokenizer"] == "byte"
    assert check.prepare_data(tmp_path / "data") == path  # prepared once
    assert capsys.readouterr() == ("", "")


def test_the_docs_counts_of_rows_are_the_plans():
    """docs/device-check.md's table is a full run's; what it says of --quick (how many rows,
    compile rows) must follow the plan, which it once did not (83 rows said, 106 run)."""
    doc = (Path(__file__).parents[2] / "docs" / "device-check.md").read_text()
    full = int(re.search(r"full matrix on the CPU: .* of (\d+) rows", doc)[1])
    quick = int(re.search(r"`--quick`, (\d+) rows", doc)[1])
    table = doc[doc.index("<details>"):doc.index("</details>")]
    assert sum(line.startswith("| ") for line in table.splitlines()) - 1 == full
    plans = {q: [matrix.plan("cpu", w, q) for w in (1, 2)] for q in (False, True)}
    assert full - quick == sum(map(len, plans[False])) - sum(map(len, plans[True]))
    compiles = {q: sum(s.case.compile for p in plans[q] for s in p) for q in (False, True)}
    assert f"one compile row instead of {compiles[False]}" in " ".join(doc.split())
    assert compiles[True] == 1

"""The rows that run ddpgpt's commands as a user does (`python -m ddpgpt train/eval/sample/export`
in a subprocess), each against an oracle:

- a checkpoint written on this device, resumed on the CPU (and the reverse): the resumed steps'
  losses against the straight run's on the resuming device, to the precision's tolerance;
- SIGTERM after step 2: exit 75 with a checkpoint, and the resumed run's losses and final
  weights equal to the straight run's, bitwise, on the same device;
- `eval`, `sample` and `export` of this device's checkpoint against the fp32 CPU model loaded
  from the same checkpoint (its val loss, its greedy continuation, transformers' logits);
- the data loader's batches copied to the device unchanged.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import torch

from ddpgpt.checkpoint import store
from ddpgpt.checkpoint.read import load_model
from ddpgpt.commands.check.matrix import VS_FP32_CPU, default_precision
from ddpgpt.commands.check.report import FAIL, PASS, Row, rel_diff, within
from ddpgpt.data.loader import EvalLoader, TrainLoader
from ddpgpt.data.shards import TokenDataset
from ddpgpt.data.tokenizer import load_tokenizer
from ddpgpt.distributed import collectives
from ddpgpt.distributed.group import DistEnv
from ddpgpt.evals.loss import evaluate
from ddpgpt.files import install
from ddpgpt.guard.health import EXIT_PREEMPTED
from ddpgpt.run.launch import ENTRY
from ddpgpt.run.run_dir import RunDir

STEPS, STOP_AT = 4, 2
PROMPT, NEW_TOKENS = "def ", 24
TIMEOUT_S = 600
TRAIN = ["--model.n-layer", "2", "--model.n-head", "2", "--model.n-embd", "64",
         "--model.block-size", "64", "--data.micro-batch", "4", "--data.global-batch", "8",
         "--data.eval-windows", "16", "--optim.lr", "1e-2", "--optim.warmup-steps", "1",
         "--run.steps", str(STEPS), "--run.checkpoint-every", str(STOP_AT), "--run.eval-every",
         "0", "--run.keep-checkpoints", "10"]


class Failed(Exception):
    """A command that did not do what its row needs: the row fails with this line."""


def ddpgpt(*args: str, fault: str = "") -> subprocess.CompletedProcess:
    """ddpgpt ARGS (this package's: launch.ENTRY) in its own session (killed whole after
    TIMEOUT_S)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("DDPGPT_FAULT", None)
    if fault:
        env["DDPGPT_FAULT"] = fault
    proc = subprocess.Popen([sys.executable, ENTRY, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise Failed(f"ddpgpt {args[0]} still running after {TIMEOUT_S} s") from None
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def succeed(*args: str, code: int = 0, fault: str = "") -> subprocess.CompletedProcess:
    r = ddpgpt(*args, fault=fault)
    if r.returncode != code:
        last = (r.stderr.strip().splitlines() or ["(no output)"])[-1][:200]
        raise Failed(f"ddpgpt {args[0]} exited {r.returncode}, not {code}: {last}")
    return r


def train(data: str, run_dir: Path, device: str, *extra: str, code: int = 0,
          fault: str = "") -> dict[int, float]:
    """The run's loss by step (the newest row of each, as a resumed run rewrites them)."""
    succeed("train", "--data", data, "--run-dir", str(run_dir), "--device", device, *TRAIN,
            *extra, code=code, fault=fault)
    return losses(run_dir)


def losses(run_dir: Path) -> dict[int, float]:
    by_step = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if "loss" in row:
            by_step[row["step"]] = row["loss"]
    return by_step


def after(losses: dict[int, float], step: int) -> list[float]:
    """The losses of the steps after `step`, in order."""
    return [losses[k] for k in sorted(losses) if k > step]


def step_dir(run_dir: Path, step: int) -> Path:
    return store.step_dir(run_dir / "checkpoints", step)


def load(run_dir: Path, device: str = "cpu"):
    """(the model of the run's newest checkpoint, its training config) on `device`."""
    model, found = load_model(RunDir(run_dir), device)
    return model, found.config


def guarded(check: str, device: str, oracle: str, fn) -> Row:
    """`fn()`'s row, or a failed row naming what went wrong."""
    try:
        return fn()
    except Failed as e:
        return Row(check, device, 1, oracle, str(e), FAIL)
    except Exception as e:  # noqa: BLE001 -- one row's failure, reported; the others go on
        from ddpgpt.commands.check.training import error_line
        return Row(check, device, 1, oracle, error_line(e), FAIL)


def rows(device: str, data: str, out: Path, selected, say) -> list[Row]:
    """The rows whose check `selected(check)` admits."""
    runs = out / "runs"
    shutil.rmtree(runs, ignore_errors=True)
    precision = default_precision(device)
    tol = VS_FP32_CPU[device, precision]
    result: list[Row] = []

    def add(check: str, oracle: str, fn) -> None:
        if not selected(check):
            return
        result.append(guarded(check, device, oracle, fn))
        say(f"{check}: {result[-1].status}")

    straight: dict[str, dict[int, float]] = {}

    def straight_run(where: str) -> dict[int, float]:
        if where not in straight:
            straight[where] = train(data, runs / f"straight-{where}", where)
        return straight[where]

    def across(source: str, target: str) -> Row:
        """Steps 1-2 on `source`, its checkpoint resumed on `target` for steps 3-4."""
        straight_run(source)
        want = straight_run(target)
        got = train(data, runs / f"{source}-to-{target}", target, "--run.resume",
                    str(step_dir(runs / f"straight-{source}", STOP_AT)))
        return within(f"checkpoint {source} → {target}", device, 1,
                      f"the straight {target} run, steps {STOP_AT + 1}-{STEPS}",
                      rel_diff(after(got, STOP_AT), after(want, STOP_AT)), tol)

    resumed = f"steps {STOP_AT + 1}-{STEPS}"
    add(f"checkpoint {device} → cpu", f"the straight cpu run, {resumed}",
        lambda: across(device, "cpu"))
    if device != "cpu":  # on a CPU the one row above is both directions
        add(f"checkpoint cpu → {device}", f"the straight {device} run, {resumed}",
            lambda: across("cpu", device))
    add("SIGTERM → exit 75 → resume", f"the straight {device} run (bitwise)", lambda: sigterm(
        data, runs, device, straight_run(device)))

    def of_straight(row_of):
        """A row of the straight run's checkpoint, trained first if no row above did."""
        def run() -> Row:
            straight_run(device)
            return row_of(runs / f"straight-{device}")
        return run

    add("eval", "the fp32 CPU model of the checkpoint",
        of_straight(lambda source: eval_row(source, device)))
    add("sample", "the fp32 CPU model, greedy, no KV cache",
        of_straight(lambda source: sample_row(source, device)))
    add("export", "the fp32 CPU model's logits",
        of_straight(lambda source: export_row(source, runs, device)))
    return result


def sigterm(data: str, runs: Path, device: str, want: dict[int, float]) -> Row:
    """SIGTERM once step STOP_AT is done: exit 75 and a checkpoint; the resume (same command) must
    retrace the straight run bitwise: every loss and the final weights."""
    run_dir = runs / "sigterm"
    train(data, run_dir, device, code=EXIT_PREEMPTED, fault=f"term@{STOP_AT}")
    stopped_at = store.find_latest(run_dir / "checkpoints")
    if stopped_at is None or stopped_at[1].get("reason") != "stop":
        raise Failed("exit 75 but no checkpoint written for the stop")
    got = train(data, run_dir, device)
    model, _ = load(run_dir)
    oracle, _ = load(runs / f"straight-{device}")
    same = (collectives.state_digest(model.state_dict())
            == collectives.state_digest(oracle.state_dict()))
    diff = max((abs(got[k] - want[k]) for k in want if k in got), default=float("inf"))
    ok = same and got == want
    figure = (f"stopped at step {stopped_at[1]['step']}, exit 75; losses max abs Δ {diff:.1e}, "
              f"final weights {'bitwise equal' if same else 'DIFFER'}")
    return Row("SIGTERM → exit 75 → resume", device, 1, f"the straight {device} run (bitwise)",
               figure, PASS if ok else FAIL)


def eval_row(run_dir: Path, device: str) -> Row:
    r = succeed("eval", "--run-dir", str(run_dir), "--device", device)
    found = re.search(r"val_loss (\d+\.\d+)", r.stdout)
    if not found:
        raise Failed(f"ddpgpt eval printed no val_loss: {r.stdout.strip()[:200]}")
    got = float(found.group(1))
    model, cfg = load(run_dir)
    loader = EvalLoader(TokenDataset(cfg.data.dir), seq_len=cfg.seq_len,
                        micro_batch=cfg.data.micro_batch, max_windows=cfg.data.eval_windows,
                        align=cfg.data.align)
    want = evaluate(model, loader, DistEnv())
    # eval prints 4 decimals: half a unit of the last one is rounding, not error
    tol = VS_FP32_CPU[device, default_precision(device)] + 5e-5 / want
    row = within("eval", device, 1, "the fp32 CPU model of the checkpoint",
                 abs(got - want) / want, tol, "val_loss rel Δ")
    row.figure = f"val_loss {got:.4f} vs {want:.4f}; {row.figure}"
    return row


def sample_row(run_dir: Path, device: str) -> Row:
    """`sample --top-k 1` (greedy, KV cache) on the device against the fp32 CPU model's greedy
    tokens without a cache. They may part only where the fp32 model's two best tokens are within
    the precision's rounding of each other: in fp32 the cache's one-row products round otherwise
    than the whole context's (~1e-6 of a logit), in bf16 ~3 significant digits."""
    r = succeed("sample", "--run-dir", str(run_dir), "--device", device, "--prompt", PROMPT,
                "--max-new-tokens", str(NEW_TOKENS), "--top-k", "1")
    text = r.stdout.rstrip("\n")
    model, cfg = load(run_dir)
    tok = load_tokenizer(run_dir, RunDir(run_dir).read_data_meta("check needs")["tokenizer"])
    prompt = tok.encode_batch([PROMPT])[0].tolist()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        want = model.generate(ids, NEW_TOKENS, top_k=1, vocab_size=tok.vocab_size,
                              use_cache=False)[0].tolist()
    oracle = "the fp32 CPU model, greedy, no KV cache"
    if text == tok.decode(want):
        return Row("sample", device, 1, oracle, f"{NEW_TOKENS} tokens equal", PASS)
    # where the texts part: the first token whose text is not a prefix of the command's
    k = next(k for k in range(len(prompt), len(want) + 1)
             if not text.startswith(tok.decode(want[:k])))
    with torch.no_grad():
        logits = model(torch.tensor([want[:k - 1]]))[0][0, -1, :tok.vocab_size]
    top2 = logits.topk(2).values
    gap = (top2[0] - top2[1]).item()
    tie = 1e-4 if default_precision(device) == "fp32" else 0.1
    figure = (f"parts at token {k - len(prompt)} of {NEW_TOKENS}, where the two best fp32 logits "
              f"are {gap:.1e} apart (a tie within {tie:g})")
    return Row("sample", device, 1, oracle, figure, PASS if gap <= tie else FAIL)


def export_row(run_dir: Path, runs: Path, device: str) -> Row:
    oracle = "the fp32 CPU model's logits"
    if importlib.util.find_spec("transformers") is None:
        return Row.needs("export", device, 1, oracle, f"transformers ({install('export')})")
    out = runs / "export"
    succeed("export", "--run-dir", str(run_dir), "--out", str(out), "--force")
    import transformers

    transformers.utils.logging.disable_progress_bar()
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    model, cfg = load(run_dir)
    vocab = theirs.config.vocab_size
    x = next(iter(EvalLoader(TokenDataset(cfg.data.dir), seq_len=cfg.seq_len, micro_batch=2,
                             max_windows=2)))[0]
    with torch.no_grad():
        diff = (model(x)[0][..., :vocab] - theirs(x).logits).abs().max().item()
    return within("export", device, 1, oracle, diff, 1e-5, "transformers' logits max abs Δ")


def loader_row(env: DistEnv, data: str) -> Row:
    """tests/gpu's first check: the loader's batches on the device equal the CPU loader's."""
    dataset = TokenDataset(data)
    cpu = TrainLoader(dataset, seq_len=32, micro_batch=4, accum_steps=2, seed=3)
    here = TrainLoader(dataset, seq_len=32, micro_batch=4, accum_steps=2, seed=3,
                       device=env.device)
    same = all(x.device.type == env.device.type and torch.equal(x.cpu(), xc)
               and torch.equal(y.cpu(), yc)
               for _ in range(3)
               for (xc, yc), (x, y) in zip(cpu.next_step(), here.next_step()))
    return Row("loader copy", env.device.type, 1, "the CPU loader's batches",
               "3 steps × 2 micro-batches " + ("equal" if same else "DIFFER"),
               PASS if same else FAIL)

"""The rows of `ddpgpt check` and what it writes: one table (printed, device-check.md) and the
same rows as JSON (device-check.json), under a header naming the machine and the versions."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import resource
import subprocess
from pathlib import Path

import torch

from ddpgpt import __version__
from ddpgpt.errors import UserError
from ddpgpt.files import describe

PASS, FAIL, NOT_RUN = "pass", "fail", "not run"


@dataclasses.dataclass
class Row:
    """One check: what ran where, what it was compared with, the figure, and the verdict. A row
    that could not run here says what it needs in `figure` (never a silent skip, never a pass)."""
    check: str
    device: str
    world: int
    oracle: str
    figure: str
    status: str

    @classmethod
    def needs(cls, check: str, device: str, world: int, oracle: str, what: str) -> Row:
        return cls(check, device, world, oracle, f"needs {what}", NOT_RUN)


def within(check: str, device: str, world: int, oracle: str, diff: float, tol: float,
           what: str = "max rel Δ loss") -> Row:
    """A row passing when `diff` (a relative difference) is within `tol`."""
    ok = diff <= tol  # a NaN fails
    return Row(check, device, world, oracle, f"{what} {diff:.1e} (≤ {tol:.0e})",
               PASS if ok else FAIL)


def rel_diff(got: list[float], want: list[float]) -> float:
    """The largest relative difference of two equally long loss curves (inf if the lengths
    differ, NaN if either has a NaN)."""
    if len(got) != len(want) or not got:
        return float("inf")
    diffs = [abs(a - b) / abs(b) if b else abs(a - b) for a, b in zip(got, want)]
    return math.nan if any(map(math.isnan, diffs)) else max(diffs)  # max() would pass over a NaN


def driver_version() -> str:
    """The NVIDIA driver's version from nvidia-smi (torch does not report it)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return "unknown (no nvidia-smi)"
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout else "unknown"


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(device: torch.device) -> dict:
    """The versions and the hardware the rows ran on."""
    env = {"ddpgpt": __version__, "python": platform.python_version(), "torch": torch.__version__,
           "cpu": f"{cpu_name()}, {len(os.sched_getaffinity(0))} usable cores",
           "device": device.type}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        nccl = torch.cuda.nccl.version() if torch.distributed.is_nccl_available() else None
        if isinstance(nccl, int):  # older torch: major*1000 + minor*100 + patch
            nccl = (nccl // 1000, nccl % 1000 // 100, nccl % 100)
        env.update(cuda=torch.version.cuda, nccl=".".join(map(str, nccl)) if nccl else "none",
                   driver=driver_version(), gpus=torch.cuda.device_count(),
                   gpu=f"{props.name}, {props.total_memory / 2**30:.0f} GiB")
    else:
        env.update(cuda=torch.version.cuda or "none (a CPU build of torch)",
                   nccl="none (no CUDA)", driver="none (no GPU)")
    return env


def header(env: dict) -> str:
    where = f"{env['gpus']} × {env['gpu']}" if env.get("gpu") else env["cpu"]
    return (f"ddpgpt {env['ddpgpt']}, torch {env['torch']}, CUDA {env['cuda']}, "
            f"NCCL {env['nccl']}, driver {env['driver']}, python {env['python']}; "
            f"device {env['device']}: {where}")


def table(rows: list[Row]) -> str:
    """The rows as one Markdown table (also what is printed)."""
    lines = ["| check | device | W | compared with | figure | result |",
             "|---|---|---:|---|---|---|"]
    lines += ["| " + " | ".join(str(cell).replace("|", "\\|") for cell in
                               (r.check, r.device, r.world, r.oracle, r.figure, r.status)) + " |"
              for r in rows]
    return "\n".join(lines)


def counts(rows: list[Row]) -> str:
    n = {s: sum(r.status == s for r in rows) for s in (PASS, FAIL, NOT_RUN)}
    return f"{n[PASS]} passed, {n[FAIL]} failed, {n[NOT_RUN]} not run, of {len(rows)} rows"


def took(seconds: float) -> dict:
    """The check's wall time, the CPU time it and its workers spent, and the machine's load at
    the end: on a shared machine the wall time follows the load, the CPU time much less."""
    cpu = sum(getattr(resource.getrusage(who), part)
              for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
              for part in ("ru_utime", "ru_stime"))
    return {"seconds": round(seconds, 1), "cpu_seconds": round(cpu, 1),
            "load": round(os.getloadavg()[0], 1)}


def took_text(t: dict) -> str:
    return (f"{t['seconds']:.0f} s ({t['cpu_seconds']:.0f} s of CPU time; a load of "
            f"{t['load']:.1f} at the end)")


def write(out: Path, env: dict, rows: list[Row], what: str, time: dict) -> list[Path]:
    """device-check.md and device-check.json in `out`; one line if they cannot be written (the
    printed table still holds the rows). `what`: the scope (full matrix, quick subset, ...);
    `time`: `took`'s."""
    md = (f"# ddpgpt device check ({what})\n\n{header(env)}\n\n{table(rows)}\n\n"
          f"{counts(rows)}; {took_text(time)}\n")
    data = {"environment": env, "scope": what, **time,
            "rows": [dataclasses.asdict(r) for r in rows]}
    paths = [out / "device-check.md", out / "device-check.json"]
    try:
        paths[0].write_text(md)
        paths[1].write_text(json.dumps(data, indent=1) + "\n")
    except OSError as e:
        raise UserError(f"cannot write the report into --out {out}: {describe(e)}; the table "
                        "above holds it") from None
    return paths

"""A checkpoint saved again whose swap into place was cut short (a kill between its steps),
met by the next start: the start goes on from that step, in its own step_NNNNNNN/, and says so
in one line naming it; never "no meta.json", a .tmp or .old path, an older checkpoint, nor a
refusal to go on (checkpoint/swap.py). The cut-short state is built on disk and at a URL as the
swap leaves it: locally the previous copy renamed aside and the new one not yet renamed in; in
object storage the previous copy deleted and the new one complete under its temporary prefix."""

from __future__ import annotations

import shutil

import pytest

from tests.helpers import tiny_train_args
from tests.processes import run_cli

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]


def cut_short(s3, where, step: int = 4) -> None:
    name = f"step_{step:07d}"
    if isinstance(where, str):  # a URL: the swap's first half done, its second not begun
        fs, key = s3.fs(), where[5:]
        for obj in fs.find(f"{key}/{name}"):
            fs.copy(obj, obj.replace(f"/{name}/", f"/.tmp-{name}-77/"))
        fs.rm(fs.find(f"{key}/{name}"))
        return
    (where / name).rename(where / f".old-{name}-77")  # between publish_dir's two renames
    shutil.copytree(where / f".old-{name}-77", where / f".tmp-{name}-77")


@pytest.mark.parametrize("where, resume, nproc", [
    ("local", "auto", 1), ("local", "explicit", 1), ("url", "auto", 1), ("local", "auto", 2)])
def test_a_start_after_a_swap_cut_short_goes_on_from_that_step(s3, tiny_data, tmp_path, where,
                                                                resume, nproc):
    """(At W = 2 rank 0 puts the copy back and every rank loads the step from its place.)"""
    run = tmp_path / "run"
    url = s3.bucket("swap") + f"/{resume}" if where == "url" else None
    args = tiny_train_args(tiny_data, run, 4, run__checkpoint_every=2,
                           run__keep_checkpoints=1)[3:]
    args += ["--run.checkpoint-url", url] if url else []
    first = run_cli("train", *args, timeout=180)
    assert first.returncode == 0, first.stderr
    checkpoints = url or run / "checkpoints"
    cut_short(s3, checkpoints)
    extra = ["--resume", str(run / "checkpoints" / "step_0000004")] if resume == "explicit" \
        else []
    out = run_cli("train", *args, "--run.steps", "6", "--nproc", str(nproc), *extra, timeout=180)
    assert out.returncode == 0, out.stderr
    which = "the new copy, complete," if url else "the previous copy"
    assert (f"ddpgpt: note: checkpoint {checkpoints}/step_0000004: saving step 4 again was cut "
            f"short while swapping the new copy in; {which} is back in place, and this start "
            "goes on from it\n") in out.stderr
    assert f"resuming from {checkpoints}/step_0000004 (step 4, saved at world size 1)" \
        in out.stderr and out.stderr.count("back in place") == 1
    assert not any(bad in out.stderr for bad in (".old-", ".tmp-", "no meta.json")), out.stderr
    listed = sorted(p.rsplit("/", 1)[-1] for p in s3.fs().ls(url[5:])) if url else \
        sorted(p.name for p in (run / "checkpoints").iterdir())
    assert "step_0000006" in listed and not any(n.startswith(".") for n in listed), listed

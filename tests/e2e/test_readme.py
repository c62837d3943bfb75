"""README's commands, run: every command of its ```bash blocks that can run offline on a CPU runs
here, in README's order, in one directory that holds small versions of what README's commands
read (text under notes/ and books/, FineWeb-Edu-shaped parquet files, llm.c shards). A README
command that stops working fails this test.

Two changes make them small, and only these: every `train` runs 1/200 of the steps it names (a
new run of the tiny preset's 200 steps: 1; a run continued to `--run.steps N`: to N/200, a new
schedule from `--optim.schedule-start S` at S/200), on the CPU. The commands that cannot run
here are in SKIPPED, each with its reason, matched by the command: a command that is neither run
nor listed fails the test until it is classified."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import CORPUS, STDLIB
from tests.helpers import REPO, TIKTOKEN_GPT2
from tests.processes import kill_tree

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

SKIPPED = {
    r"^make demo$": "the multi-minute demo itself (its steps are the commands below, run small)",
    r"^make test$": "this suite",
    r"^source \.venv/bin/activate$": "this test runs in that environment",
    r"--init-from gpt2 ": "downloads GPT-2's weights (network); the config it builds is checked "
                          "offline in tests/unit/test_config.py, --init-from a local directory "
                          "in tests/e2e/test_hf_gpt2.py",
    r"--preset gpt2-124m --compile$": "a GPU",
    r"^torchrun --standalone --nproc_per_node 8 ": "8 GPUs",
    r"^torchrun --nnodes 2 ": "two machines of 8 GPUs",
    r"^sbatch ": "a SLURM cluster",
    r"^ddpgpt .*s3://BUCKET/": "a bucket in object storage; tests/e2e/test_object_storage.py runs "
                               "these commands against a local S3 server (moto's)",
}


def commands(readme: str) -> list[str]:
    """Each command of README's ```bash blocks: continuation lines joined, comments dropped."""
    out = []
    for block in re.findall(r"^```bash\n(.*?)^```", readme, flags=re.M | re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words:
                out.append(shlex.join(words))
    return out


def skipped(command: str) -> str | None:
    reasons = [why for pattern, why in SKIPPED.items() if re.search(pattern, command)]
    assert len(reasons) <= 1, f"{command}: matched by {len(reasons)} entries of SKIPPED"
    return reasons[0] if reasons else None


def small(words: list[str]) -> list[str]:
    """A `train` command made small as the module says; any other command as it is."""
    if "|" in words:  # a pipeline: its ddpgpt command's
        i = words.index("|") + 1
        return [*words[:i], *small(words[i:])]
    if words[:2] != ["ddpgpt", "train"]:
        return words
    for flag in ("--run.steps", "--optim.schedule-start"):  # a step: 1/200 of it too
        if flag in words:
            i = words.index(flag) + 1
            words = [*words[:i], str(int(words[i]) // 200), *words[i + 1:]]
    if "--run.steps" not in words:
        assert "--preset" in words, f"{shlex.join(words)}: neither a preset nor --run.steps"
        words = [*words, "--run.steps", "1"]
    return [*words, "--device", "cpu"]


def write_inputs(root: Path) -> None:
    """What README's commands read, small: your text, FineWeb-Edu's parquet, llm.c's shards,
    and `make demo`'s data/stdlib (a few of the library's files, a small bpe)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from ddpgpt.config.commands import PrepareConfig
    from ddpgpt.data.prepare import main as prepare

    prepare.run(PrepareConfig(sources=[str(STDLIB / f) for f in CORPUS], vocab_size=512,
                              val_fraction=0.3, out=str(root / "data" / "stdlib"), workers=1))
    texts = [(STDLIB / name).read_text() for name in
             ("textwrap.py", "shlex.py", "heapq.py", "fnmatch.py", "glob.py", "bisect.py")]
    (root / "notes").mkdir()
    (root / "books" / "a" / "b").mkdir(parents=True)
    for i, text in enumerate(texts[:3]):
        (root / "notes" / f"{i}.md").write_text(text)
    for i, text in enumerate(texts[3:]):
        (root / "books" / "a" / "b" / f"{i}.txt").write_text(text)
    parquet = root / "fineweb-edu" / "sample" / "10BT"
    parquet.mkdir(parents=True)
    for i in range(2):
        pq.write_table(pa.table({"text": texts[i::2], "id": list(range(len(texts[i::2])))}),
                       parquet / f"00{i}_00000.parquet")
    (root / "edu_fineweb10B").mkdir()
    rng = np.random.default_rng(0)
    for name, n in (("edu_fineweb_val_000000.bin", 3000), ("edu_fineweb_train_000001.bin", 9000)):
        header = np.zeros(256, dtype="<i4")
        header[:3] = 20240520, 1, n
        tokens = rng.integers(0, 50257, n).astype("<u2")
        (root / "edu_fineweb10B" / name).write_bytes(header.tobytes() + tokens.tobytes())


def run(words: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """The command (a pipeline's through the shell), ddpgpt as this interpreter's module."""
    ddpgpt = [sys.executable, "-m", "ddpgpt"]
    argv = [w for i, word in enumerate(words) for w in (
        ddpgpt if word == "ddpgpt" and (i == 0 or words[i - 1] == "|") else [word])]
    if "|" in words:
        argv = ["bash", "-o", "pipefail", "-c", shlex.join(argv).replace(" '|' ", " | ")]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TIKTOKEN_CACHE_DIR": str(TIKTOKEN_GPT2)}
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=240)
    except BaseException:
        kill_tree(proc.pid)
        raise
    return subprocess.CompletedProcess(argv, proc.returncode, out)


def test_every_readme_command_runs_or_says_why_not(tmp_path):
    if not TIKTOKEN_GPT2.is_dir():
        pytest.skip(f"GPT-2's tokenizer files for tiktoken, offline: {TIKTOKEN_GPT2}")
    listed = commands((REPO / "README.md").read_text())
    assert len(listed) >= 15, listed  # the blocks were found
    unused = [p for p in SKIPPED if not any(re.search(p, c) for c in listed)]
    assert not unused, f"SKIPPED entries no README command matches any more: {unused}"
    write_inputs(tmp_path)
    ran = []
    for command in listed:
        if skipped(command):
            continue
        words = small(shlex.split(command))
        r = run(words, tmp_path)
        assert r.returncode == 0, f"README's `{command}` (run as `{shlex.join(words)}`):\n" \
                                  f"{r.stdout[-3000:]}"
        ran.append(command)
    assert any(c.startswith("ddpgpt train") for c in ran) and len(ran) >= 10, ran
    # what the commands made is what README says they make
    assert (tmp_path / "runs" / "mine.png").is_file()
    assert (tmp_path / "exported" / "mine" / "model.safetensors").is_file()
    for data in ("mine", "edu10b", "edu", "edu10b-merged", "mine-gpt2", "chat"):
        assert (tmp_path / "data" / data / "meta.json").is_file(), data
    assert ((tmp_path / "data" / "edu10b" / "train_000000.bin").read_bytes()
            == (tmp_path / "data" / "edu10b-merged" / "train_000000.bin").read_bytes())


def test_what_readmes_commands_write_git_ignores():
    """Every --out and --run-dir of README's commands (datasets, runs, parts, exports; not the
    object storage's): a clone where they were run stays clean."""
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    paths = set()
    for command in commands((REPO / "README.md").read_text()):
        words = shlex.split(command)
        paths |= {words[words.index(f) + 1] for f in ("--out", "--run-dir")
                  if f in words and "://" not in words[words.index(f) + 1]}  # not a URL's
    assert {"data/mine", "runs/mine", "parts/1", "exported/mine"} <= paths
    ignored = subprocess.run(["git", "check-ignore", *sorted(paths)], cwd=REPO,
                             capture_output=True, text=True, timeout=60).stdout.split()
    assert ignored == sorted(paths)


def anchor(heading: str) -> str:
    """GitHub's anchor for a Markdown heading: lower case, punctuation dropped, spaces dashed."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_link_in_readme_leads_somewhere():
    """docs/X.md and docs/X.md#heading: the file exists and has that heading."""
    text = (REPO / "README.md").read_text()
    links = re.findall(r"\]\(((?!https?:)[^)#]+)(?:#([^)]+))?\)", text)
    assert len(links) >= 10, links
    for path, fragment in links:
        target = REPO / path
        assert target.is_file(), path
        if fragment:
            headings = re.findall(r"^#+ (.+)$", target.read_text(), flags=re.M)
            assert fragment in {anchor(h) for h in headings}, f"{path}#{fragment}"

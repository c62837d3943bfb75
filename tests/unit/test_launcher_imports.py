"""`train --nproc N`'s launcher only launches: it checks the config, the data and the run dir, then
starts the workers. It never imports torch.distributed.checkpoint (DCP) nor torch._dynamo, ~1 CPU s
each, which only the workers use (a checkpoint written or read, a model built)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np

from tests.helpers import REPO, tiny_train_args, write_dataset

HEAVY = ("torch._dynamo", "torch.distributed.checkpoint", "ddpgpt.checkpoint.sharded",
         "ddpgpt.model.gpt")

# The launcher's whole start in a fresh interpreter, up to the workers' launch (launch.start,
# replaced by a report of what was imported by then).
SCRIPT = """
import json, sys
from ddpgpt import cli
from ddpgpt.run import launch

def start(nproc, worker_args, max_restarts=0):
    print(json.dumps({name: name in sys.modules for name in %r}))
    return 0, None

launch.start = start
cli.main(sys.argv[1:])
"""


def _imported(*code_and_args: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", *code_and_args], capture_output=True, text=True,
                          cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


def test_importing_the_launcher_imports_neither():
    code = (f"import json, sys; import ddpgpt.cli, ddpgpt.run.launch; "
            f"print(json.dumps({{n: n in sys.modules for n in {HEAVY!r}}}))")
    assert _imported(code) == dict.fromkeys(HEAVY, False)


def test_a_launch_of_two_workers_imports_neither(tmp_path):
    """train --nproc 2 on a dataset, through its checks, the run dir and config.json, to the
    launch of its workers."""
    rng = np.random.default_rng(0)
    data = write_dataset(tmp_path / "data", rng.integers(0, 64, 4000), rng.integers(0, 64, 1000),
                         vocab_size=64)
    args = tiny_train_args(data, tmp_path / "run", steps=2)[2:]
    assert _imported(SCRIPT % (HEAVY,), *args, "--nproc", "2") == dict.fromkeys(HEAVY, False)
    assert (tmp_path / "run" / "config.json").is_file()  # it got as far as writing the config

"""The test suite itself: `pytest` from the repo root must collect every test directory."""

import subprocess
import sys

from tests.helpers import REPO


def test_every_test_directory_is_collected():
    """pytest skips directories named `dist` by default; pyproject's norecursedirs must not.
    The collection from the root reads one file name found in every directory (test_core.py;
    tests/gpu: test_flex.py), not every module of the suite."""
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                          "-p", "no:cacheprovider", "-o", "python_files=test_core.py test_flex.py"],
                         cwd=REPO, capture_output=True, text=True, timeout=120).stdout
    collected = {line.split("::")[0].split("/")[1] for line in out.splitlines()
                 if line.startswith("tests/")}
    assert collected == {"dist", "e2e", "gpu", "unit"}

"""`python -m ddpgpt ...` and `torchrun -m ddpgpt train ...` both land here; so do the processes
ddpgpt starts itself (`--nproc`'s workers, `ddpgpt check`'s commands), which run this file by its
path (run/launch.py: ENTRY). Run by its path, Python puts this file's directory first on
sys.path, not the current one; that entry becomes its parent, so they import the very package
their launcher imported, whatever a `ddpgpt` folder in the current directory holds (the parent
of a clone, an older copy)."""

import os
import sys

if not __package__:  # run by its path (ENTRY), not as a module
    _here = os.path.dirname(os.path.abspath(__file__))
    if sys.path and os.path.abspath(sys.path[0] or os.curdir) == _here:
        sys.path[0] = os.path.dirname(_here)

from ddpgpt.cli import main  # noqa: E402  (the package found as above)

if __name__ == "__main__":
    main()

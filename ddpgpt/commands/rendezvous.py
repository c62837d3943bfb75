"""`ddpgpt rendezvous`: hosts the rendezvous store of elastic jobs (torchrun --nnodes MIN:MAX) on
a node that does not train, so that the job outlives any of its training nodes.

    ddpgpt rendezvous --port 29500
    torchrun --nnodes 1:4 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        --rdzv-conf is_host=0 -m ddpgpt train ...                     # on every training node
"""

from __future__ import annotations

import socket
import sys

from ddpgpt.config.commands import RendezvousConfig
from ddpgpt.distributed.group import serve_store


def run(cfg: RendezvousConfig) -> None:
    """Serves until stopped (Ctrl-C, SIGTERM); prints how the nodes reach it."""
    where = f"{socket.getfqdn()}:{cfg.port}"
    serve_store(cfg.host, cfg.port, ready=lambda: print(
        f"ddpgpt: rendezvous store on {cfg.host}:{cfg.port}; start every node with "
        f"--rdzv-backend c10d --rdzv-endpoint {where} --rdzv-conf is_host=0; Ctrl-C ends it",
        file=sys.stderr, flush=True))

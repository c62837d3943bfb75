"""A sixth sync mode, whole: its Sync (plain all-reduce of every gradient once the last backward
is done, under its own name) and its row of the mode table, added from outside the package. Run as
`python -m tests.dist.toy_sync train ...`: the row is registered, then ddpgpt's own command line
runs, so `--run.sync toy` reaches preflight, `make` and the Trainer like any built-in mode."""

import sys

from ddpgpt.distributed import collectives
from ddpgpt.sync.base import Replicated
from ddpgpt.sync.modes import MODES, Mode


class ToySync(Replicated):
    """Gradients accumulate locally over the micro-steps; `finish` sums them across ranks, one
    tensor at a time, and divides by W: every rank then holds the mean gradient."""

    def __init__(self, model, groups, env, bucket_mb, mode="toy", compress="none"):
        super().__init__(model, groups, env, bucket_mb)
        self.name = mode

    def finish(self) -> None:
        for group in self.groups:
            for p in group.params:
                if p.grad is not None:
                    collectives.all_reduce(self.env, p.grad).div_(self.env.world_size)


ROW = Mode("toy", "tests.dist.toy_sync:ToySync", "plain all-reduce after the backward",
           shards_state=False, shards_params=False, loss_scaler=True, compression=False,
           reduce_scatter=False, sent=lambda t: t.ring * 2 * t.grad_bytes * t.params,
           exposed=lambda t, bandwidth, micro_s: t.ring * 2 * t.grad_bytes * t.params / bandwidth,
           memory=lambda world, layers: 16.0,
           why_not={"compression": "it all-reduces the gradients in their own dtype"})

if __name__ == "__main__":
    MODES[ROW.name] = ROW
    from ddpgpt.cli import main

    main(sys.argv[1:])

"""The shards' hashes checked at a start (data.verify), the work shared by the ranks: each hashes
1/W of the shards that verified.json does not vouch for (data/verify.py), and each node's first
rank records every rank's new entries."""

from __future__ import annotations

import json

from ddpgpt.data import verify
from ddpgpt.data.mixture import MixedDataset, datasets
from ddpgpt.data.shards import TokenDataset
from ddpgpt.distributed import collectives
from ddpgpt.distributed.group import DistEnv


def verify_data(env: DistEnv, data: TokenDataset | MixedDataset) -> None:
    """data.verify: the sha256 of the shards that verified.json does not vouch for, 1/W of the
    shards per rank (data/verify.py); every rank's new entries recorded by each node's first.
    A mixture: each dataset in turn."""
    for dataset in datasets(data):
        mine = collectives.together(env, lambda ds=dataset: verify.hash_share(ds, env.rank,
                                                                              env.world_size))
        entries = {}
        for text in collectives.all_gather_text(env, json.dumps(mine)):
            entries.update(json.loads(text))
        if env.local_rank == 0:
            verify.record(dataset.files, entries, quiet=not env.is_main)

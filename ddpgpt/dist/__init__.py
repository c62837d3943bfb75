"""Process groups (group.py: the environment, devices, a group's life) and the collectives over
them (collectives.py): the only place that reads torchrun's environment or touches a process
group."""

from ddpgpt.dist.collectives import (  # noqa: F401
    agree,
    all_gather,
    all_gather_async,
    all_gather_into,
    all_gather_text,
    all_reduce,
    all_reduce_async,
    all_to_all,
    barrier,
    digest,
    fail_together,
    reduce_scatter_async,
    state_digest,
    together,
)
from ddpgpt.dist.group import (  # noqa: F401 -- the package's face
    CollectiveError,
    DistEnv,
    DistError,
    checkpoint_group,
    collective,
    default_backend,
    detect,
    die_with_launcher,
    elastic_nodes,
    init,
    launcher_id,
    parse_nnodes,
    resolve_device,
    serve_store,
    session,
    shutdown,
    under_launcher,
)

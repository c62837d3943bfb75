"""Checkpoints: the store (store.py: layout, atomic publication, prune), reading them back and a
run's model (read.py), each rank's share through torch.distributed.checkpoint (sharded.py) and
saving in the background (saver.py)."""

from ddpgpt.checkpoint.read import (  # noqa: F401
    Saved,
    export_safetensors,
    load,
    load_latest,
    load_model,
    load_weights,
    model_of,
    open_sharded,
    read_into,
    read_tensors,
    read_verified,
    saved,
    weights,
)
from ddpgpt.checkpoint.store import (  # noqa: F401 -- the package's face
    FORMAT_VERSION,
    ROLLBACK,
    STEP_DIR,
    TEMPORARY,
    CheckpointError,
    CheckpointGone,
    CheckpointVersionError,
    commit,
    find_latest,
    hash_files,
    pending_rollback,
    prune,
    read_meta,
    record_rollback,
    remove_temporaries,
    save,
    step_dir,
    step_dirs,
    superseded,
    temporary,
)

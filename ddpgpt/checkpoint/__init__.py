"""Checkpoints: the store (store.py: layout, atomic publication, validated load, prune), each
rank's share through torch.distributed.checkpoint (sharded.py) and saving in the background
(saver.py)."""

from ddpgpt.checkpoint.store import (  # noqa: F401 -- the package's face
    FORMAT_VERSION,
    STEP_DIR,
    TEMPORARY,
    CheckpointError,
    CheckpointGone,
    CheckpointVersionError,
    commit,
    export_safetensors,
    find_latest,
    hash_files,
    load,
    load_latest,
    load_weights,
    open_sharded,
    prune,
    read_into,
    read_meta,
    read_tensors,
    read_verified,
    remove_temporaries,
    save,
    step_dir,
    step_dirs,
    temporary,
    weights,
)

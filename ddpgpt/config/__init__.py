"""Typed configuration (schema.py; the model's in model.py, the checks every section runs in
checks.py), the other commands' settings (commands.py), configs in and out of text (io.py) and
named presets (presets.py). Imports nothing of ddpgpt but errors."""

from ddpgpt.config.schema import (  # noqa: F401 -- the package's face
    MAX_BUCKET_MB,
    MAX_TIMEOUT_S,
    SECTIONS,
    ConfigError,
    DataConfig,
    ModelConfig,
    OptimConfig,
    RunConfig,
    TrainConfig,
)

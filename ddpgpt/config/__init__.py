"""Typed configuration (schema.py; the model's in model.py, the optimizer's and its schedule's in
optim.py, the checks every section runs in checks.py), every setting's choices (choices.py), the
other commands' settings (commands.py), configs in and out of text (io.py) and named presets
(presets.py). Imports nothing of ddpgpt but errors."""

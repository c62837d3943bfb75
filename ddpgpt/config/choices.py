"""Every choice a setting offers, as one `Literal` type: the field's annotation (schema.py,
commands.py), what its validation checks (`_choice` reads typing.get_args of it), and what any
other room that needs the list reads. There is no other copy of these lists.

A setting whose choices are a table somewhere else is a plain str checked against that table:
run.sync (sync/modes.py's MODES: a new mode is a row there), run.resume (auto, never, reset or a
path).
"""

from __future__ import annotations

from typing import Literal

Device = Literal["auto", "cpu", "cuda"]
Backend = Literal["auto", "nccl", "gloo"]
Precision = Literal["auto", "fp32", "bf16", "fp16"]
GradCompress = Literal["none", "bf16"]
OnNonfinite = Literal["spike", "stop", "skip"]
OnSpike = Literal["none", "stop", "recover"]
Tracker = Literal["none", "tensorboard", "wandb"]
Gelu = Literal["tanh", "exact"]
Arch = Literal["gpt2", "modern"]
Norm = Literal["layernorm", "rmsnorm"]
Mlp = Literal["gelu", "relu2", "swiglu"]
Optimizer = Literal["adamw", "muon"]
Schedule = Literal["cosine", "wsd", "constant"]
NewtonSchulz = Literal["quintic", "polar"]
NewtonSchulzDtype = Literal["auto", "fp32", "bf16"]
Tokenizer = Literal["bpe", "byte", "gpt2"]
Align = Literal["auto", "stream", "bos"]
Attention = Literal["auto", "sdpa", "flex"]
Kernels = Literal["eager", "compiled"]

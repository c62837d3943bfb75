"""ddpgpt: data-parallel GPT training on torch.distributed, from one CPU process to many GPU
nodes."""

__version__ = "0.1.0"

"""Hugging Face's side: GPT-2's (transformers') weight layout and ours (gpt2.py), and pretrained
weights in (init_from.py: --model.init-from). `ddpgpt export` writes transformers directories
with both."""

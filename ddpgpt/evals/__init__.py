"""Evaluations that make runs comparable: the validation loss (loss.py), and eval tasks scored
by their kind (kinds.py: the table of kinds; multiple_choice.py, llm.c's HellaSwag rule), read
from task files (tasks.py) and run together by scorer.py, by `ddpgpt eval --task` and during
training (run.eval_tasks)."""

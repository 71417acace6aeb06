"""HumanEval+ (evalplus v0.1.10, Apache-2.0): HumanEval's 164 problems with many more test inputs, read offline
from the copy in diversed/tasks/data/humanevalplus.

Split as humaneval's (diversed.tasks.humaneval): HumanEval/k is "test" when k % 4 == 0 (41 problems), "train"
otherwise (123), so a head trained on either data set's train split never sees a test problem of the other.

The rows' own "test" field holds only HumanEval's original asserts. The plus tests are the inputs (base_input and
plus_input, evalplus's "base + plus"), judged as evalplus does: the output must equal the canonical solution's on
the same input, or be within the row's atol (rtol 1e-7) where it gives one or the expected output is float(s)
(atol 1e-6 then); find_zero (HumanEval/32) passes when the polynomial is within atol of 0 at the returned point.
Each problem's tests are a program defining check(candidate) (PLUS_CHECK), run in the sandbox after the
completion: it computes the expected outputs with the canonical solution there, in a namespace of its own.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from string import Template

from diversed.tasks.humaneval import CodeProblem, code_examples, in_split
from diversed.tasks.offline import DATA_DIR, check_split, read_text
from diversed.tasks.task import Example, Task, tests_pass

SPLITS = ("train", "test", "all")
# Wall-clock limit of one problem's check. The slowest reference (HumanEval/139) takes about 5 s over its inputs
# here and the candidate runs after it; a candidate stuck on an input fails sooner, at its per-input limit.
TIMEOUT_S = 60
# Everything lives inside check() so that the test code defines no global name but check, as HumanEval's tests.
# A candidate's call may take 4x the reference's time on the same input, at least 1 s (evalplus's defaults).
# The inputs are deep-copied for every call: some functions change their arguments.
PLUS_CHECK = Template('''
def check(candidate):
    import copy, json, math, signal, time

    reference = {}
    exec($reference, reference)
    solution = reference[$entry_point]
    atol = $atol

    def too_slow(signum, frame):
        raise TimeoutError("over the time limit of this input")

    signal.signal(signal.SIGALRM, too_slow)
    for args in json.loads($inputs):
        start = time.perf_counter()
        expected = solution(*copy.deepcopy(args))
        signal.setitimer(signal.ITIMER_REAL, max(1.0, 4 * (time.perf_counter() - start)))
        try:
            out = candidate(*copy.deepcopy(args))
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        if $entry_point == "find_zero":  # any zero will do
            assert abs(sum(c * math.pow(out, i) for i, c in enumerate(args[0]))) <= atol
        elif out != expected:
            floats = isinstance(expected, float) or (
                isinstance(expected, (list, tuple)) and expected and all(isinstance(x, float) for x in expected))
            tolerance = atol or (1e-6 if floats else 0)
            assert tolerance and type(out) is type(expected)
            outs, exps = (out, expected) if isinstance(expected, (list, tuple)) else ([out], [expected])
            assert len(outs) == len(exps)
            assert all(abs(o - e) <= tolerance + 1e-7 * abs(e) for o, e in zip(outs, exps))
''')


def plus_check(row: dict) -> str:
    """The tests of one HumanEval+ row: a program defining check(candidate) (see PLUS_CHECK)."""
    return PLUS_CHECK.substitute(reference=repr(row["prompt"] + row["canonical_solution"]),
                                 entry_point=repr(row["entry_point"]), atol=repr(float(row["atol"])),
                                 inputs=repr(json.dumps(row["base_input"] + row["plus_input"])))


def load_humaneval_plus(split: str = "test", root: Path = DATA_DIR) -> tuple[CodeProblem, ...]:
    """HumanEval+ problems of one split, in task order, with the plus tests."""
    check_split(split, SPLITS)
    return tuple(p for p in _problems(Path(root)) if in_split(p.task_id, split))


@functools.cache
def _problems(root: Path) -> tuple[CodeProblem, ...]:
    """Every problem (read and checked once, then cached)."""
    rows = map(json.loads, read_text("humanevalplus", "HumanEvalPlus.jsonl", root).splitlines())
    return tuple(CodeProblem(r["task_id"], r["prompt"], plus_check(r), r["entry_point"], r["canonical_solution"])
                 for r in rows)


def examples(split: str = "test", limit: int | None = None) -> list[Example]:
    """HumanEval+ as task examples, as humaneval's (with the plus tests)."""
    return code_examples(load_humaneval_plus(split)[:limit])


def plus_tests_pass(example: Example, completion: str) -> float:
    """pass@1 on the plus tests: tests_pass with the longer time limit (TIMEOUT_S) that they need."""
    return tests_pass(example, completion, TIMEOUT_S)


HUMANEVAL_PLUS = Task("humaneval-plus", "pass@1", examples, plus_tests_pass, stop=("\n```\n",), max_new_tokens=512)

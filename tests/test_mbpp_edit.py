"""The mbpp-edit tasks: which problems and edits they hold, their prompts and conversations, and their reward on
the reference solutions. Only a handful of sandbox runs (about 0.3 s each), skipped where bubblewrap cannot
confine programs."""

import ast
from dataclasses import replace

import pytest

from diversed.tasks import get_task
from diversed.tasks.mbpp import MbppProblem, load_mbpp
from diversed.tasks.mbpp_edit import EDITS, MBPP_EDIT, MBPP_EDIT_2TURN, clean_code, edit_for, examples, parse

SPLITS = ("test", "validation", "train", "prompt")


def _problem(task_id: int, code: str) -> MbppProblem:
    return MbppProblem(task_id, "Do it.", code, ("assert True",), "")


def _by_id(task, split: str = "test") -> dict:
    return {e.id: e for e in task.examples(split)}


# --- problems and splits


def test_splits_are_mbpps():
    assert [len(examples(split)) for split in SPLITS] == [500, 90, 374, 10]
    for split in SPLITS:
        ids = [e.id for e in examples(split)]
        assert ids == [str(p.task_id) for p in load_mbpp(split)] == [e.id for e in examples(split, turns=2)]
    assert [e.id for e in examples("test", limit=3)] == ["11", "12", "13"]


def test_tasks_are_registered_with_their_defaults():
    assert get_task("mbpp-edit") is MBPP_EDIT and get_task("mbpp-edit-2turn") is MBPP_EDIT_2TURN
    for task in (MBPP_EDIT, MBPP_EDIT_2TURN):
        assert task.metric == "pass@1" and task.stop == ("\n```\n",) and task.max_new_tokens == 512


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match=r"MBPP problem 7: its reference solution is not valid Python"):
        edit_for(_problem(7, "def f(:\n    pass\n"))
    with pytest.raises(ValueError, match="turns must be 1 or 2, got 3"):
        examples("test", turns=3)
    with pytest.raises(ValueError, match="unknown split 'dev'"):
        examples("dev")


# --- edits


def test_the_edit_cycles_over_task_ids_and_shares_out_those_that_do_not_apply():
    loop = "def f(xs):\n    out = []\n    for x in xs:\n        if x:\n            out.append(x)\n    return out\n"
    assert [edit_for(_problem(task_id, loop)).name for task_id in range(10, 15)] == [e.name for e in EDITS]
    # Slot 3 asks for a comprehension: without a loop to rewrite, the four other edits take turns there.
    no_loop = "def f(xs):\n    return [x for x in xs if x]\n"
    assert [edit_for(_problem(task_id, no_loop)).name for task_id in range(10, 15)] == [
        "type-hints", "rename", "validate", "validate", "comments"]
    assert [edit_for(_problem(task_id, no_loop)).name for task_id in (3, 8, 13, 18, 23)] == [
        "type-hints", "rename", "validate", "comments", "type-hints"]
    # A loop that stops early is no comprehension's.
    early = "def f(xs):\n    for x in xs:\n        if x:\n            return x\n"
    assert edit_for(_problem(3, early)).name == "type-hints"


def test_the_edits_are_deterministic_apply_and_all_occur():
    chosen = [e.metadata["edit"] for e in examples("test")]
    assert chosen == [e.metadata["edit"] for e in examples("test")]
    assert set(chosen) == {e.name for e in EDITS}
    edits = {e.name: e for e in EDITS}
    for problem, name in zip(load_mbpp("test"), chosen, strict=True):
        assert edits[name].applies(parse(problem)), problem.task_id


def test_clean_code_keeps_every_reference_program():
    for split in SPLITS:
        for problem in load_mbpp(split):
            code = clean_code(problem)
            # 669's trailing spaces are inside its regex's string.
            assert "\r" not in code and (" \n" in code) == (problem.task_id == 669), problem.task_id
            assert ast.dump(parse(replace(problem, code=code))) == ast.dump(parse(problem)), problem.task_id


# --- prompts and conversations


def test_the_prompt_holds_the_task_the_reference_code_and_the_edit():
    problem = load_mbpp("test")[0]
    example = _by_id(MBPP_EDIT)["11"]
    edit = edit_for(problem)
    assert example.metadata == {"edit": edit.name} and example.reference == clean_code(problem)
    assert f"```python\n{clean_code(problem)}```" in example.prompt
    assert problem.description in example.prompt and edit.request in example.prompt
    assert example.prompt.endswith("Reply with the whole edited code in one ```python block.")
    # The original asserts, as the mbpp task runs them.
    assert example.tests == _by_id(get_task("mbpp"))["11"].tests


def test_the_two_turn_form_is_a_conversation_ending_in_the_edit():
    problem = load_mbpp("test")[0]
    single, example = _by_id(MBPP_EDIT)["11"], _by_id(MBPP_EDIT_2TURN)["11"]
    first, reply, second = messages = example.metadata["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "user"]
    assert f"```python\n{clean_code(problem)}```" in first["content"] and "Reformat" in first["content"]
    assert reply["content"] == f"```python\n{ast.unparse(parse(problem))}\n```"
    assert edit_for(problem).request in second["content"] and example.metadata["edit"] == single.metadata["edit"]
    assert example.prompt == "\n\n".join(f"{m['role'].capitalize()}: {m['content']}" for m in messages)
    assert (example.id, example.tests, example.reference) == (single.id, single.tests, single.reference)


# --- rewards (sandbox)


def test_the_reference_as_an_edit_passes(sandbox):
    # 11: the first test problem; 367: needs its test setup code; 18: tab-indented in the data.
    for task_id in ("11", "367", "18"):
        example = _by_id(MBPP_EDIT)[task_id]
        assert MBPP_EDIT.reward(example, f"Here it is:\n```python\n{example.reference}```\n") == 1.0, task_id


def test_the_first_reply_of_the_conversation_passes(sandbox):
    example = _by_id(MBPP_EDIT_2TURN)["367"]
    assert MBPP_EDIT_2TURN.reward(example, example.metadata["messages"][1]["content"]) == 1.0


def test_an_edit_that_changes_behaviour_fails(sandbox):
    example = _by_id(MBPP_EDIT)["11"]
    renamed = example.reference.replace("def remove_Occ(", "def remove_occurrences(")
    assert MBPP_EDIT.reward(example, f"```python\n{renamed}```") == 0.0

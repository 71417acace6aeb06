"""MBPP edits: given a reference solution of MBPP (diversed.tasks.mbpp), change its code without changing what
it does. An input-grounded code task: the answer rewrites a program the prompt holds.

- mbpp-edit: one user turn, the reference function and one edit to make.
- mbpp-edit-2turn: a conversation. The user asks for the code to be reformatted; the assistant's reply is the
  reference run through ast.unparse (a real reformatting, applied mechanically, that keeps the program's
  meaning); then the user asks for one edit of that reply. Example.metadata["messages"] holds the
  conversation as chat messages (role and content) for the chat template; Example.prompt tells the same
  conversation in one user message, for consumers that take a string.

The edit is chosen per problem, deterministically: EDITS[task_id % len(EDITS)] when it applies to the code;
when it does not (no loop to rewrite as a comprehension, say), one of those that do, chosen by task_id too.
Problems, splits and tests are MBPP's full set (test: task_id 11-510, 500 problems): every reference solution
passes its own tests, both as the prompt shows it and as reformatted for the two-turn form (all 974 were
checked in the sandbox). Reward: pass@1, the edited code run with the problem's original asserts in the sandbox.
"""

from __future__ import annotations

import ast
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial

from diversed.tasks.mbpp import MbppProblem, load_mbpp
from diversed.tasks.mbpp import examples as mbpp_examples
from diversed.tasks.task import Example, Task, tests_pass

_KEEP = ("Keep its behaviour exactly the same: do not rename the functions or their parameters, and every "
         "call must return what it returns now.")
_REPLY = "Reply with the whole edited code in one ```python block."
_REFORMAT = ("Reformat this code in a uniform PEP 8 style: consistent spacing and indentation, no redundant "
             "parentheses (its comments may go). Reply with the code in one ```python block.")


@dataclass(frozen=True)
class Edit:
    """A behaviour-preserving change to ask for: its name, the request, and which programs it fits."""

    name: str
    request: str
    applies: Callable[[ast.Module], bool]


def _functions(tree: ast.Module) -> list[ast.FunctionDef]:
    return [node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)]


def _has_function(tree: ast.Module) -> bool:
    return bool(_functions(tree))


def _has_local_variable(tree: ast.Module) -> bool:
    """Whether a function assigns a variable (a result, a loop variable): one to rename."""
    return any(isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store)
               for function in _functions(tree) for node in ast.walk(function))


def _has_parameter(tree: ast.Module) -> bool:
    return any(function.args.posonlyargs or function.args.args or function.args.kwonlyargs
               or function.args.vararg or function.args.kwarg for function in _functions(tree))


def _accumulates(statement: ast.stmt) -> bool:
    """Whether a statement adds to a result: x.append(...), x.add(...), x += ..., or one of them under an if."""
    if isinstance(statement, ast.AugAssign):
        return True
    if isinstance(statement, ast.If):
        return not statement.orelse and len(statement.body) == 1 and _accumulates(statement.body[0])
    call = statement.value if isinstance(statement, ast.Expr) else None
    return (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
            and call.func.attr in ("append", "add"))


def _has_accumulating_loop(tree: ast.Module) -> bool:
    """Whether a for loop only builds up a result, so a comprehension (or sum() over one) can replace it; a
    loop that breaks, returns or does more may not have one."""
    return any(isinstance(node, ast.For) and not node.orelse and len(node.body) == 1 and _accumulates(node.body[0])
               for node in ast.walk(tree))


EDITS = (
    Edit("type-hints", "Add type hints to the parameters and the return value of every function, and a docstring "
         "to each function.", _has_function),
    Edit("rename", "Rename the local variables to descriptive names.", _has_local_variable),
    Edit("validate", "Add input validation: raise TypeError when an argument has a type the code cannot work "
         "with. Every input it handles now must still give the same result.", _has_parameter),
    Edit("comprehension", "Rewrite a for loop that builds up a result as a comprehension or a generator "
         "expression (inside sum(), say, if it adds up numbers).", _has_accumulating_loop),
    Edit("comments", "Add a comment before each step of the code, saying what it does.", lambda tree: True),
)


def parse(problem: MbppProblem) -> ast.Module:
    """The syntax tree of a problem's reference solution; ValueError naming the problem if it is not Python."""
    try:
        return _syntax_tree(problem.code)
    except SyntaxError as e:
        raise ValueError(f"MBPP problem {problem.task_id}: its reference solution is not valid Python "
                         f"({e.msg}, line {e.lineno})") from None


def _syntax_tree(code: str) -> ast.Module:
    with warnings.catch_warnings():
        # Many solutions write regexes as plain strings ("\d"): an invalid escape that Python warns of (with a
        # DeprecationWarning, from 3.12 a SyntaxWarning), but one of the data's own code.
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", SyntaxWarning)
        return ast.parse(code)


def edit_for(problem: MbppProblem) -> Edit:
    """The edit asked of a problem: EDITS[task_id % len(EDITS)] if it applies to the code, else the edits that
    apply taken in turn over task_id // len(EDITS) (so the fallbacks share the problems evenly)."""
    tree = parse(problem)
    turn, slot = divmod(problem.task_id, len(EDITS))
    if EDITS[slot].applies(tree):
        return EDITS[slot]
    applicable = [edit for edit in EDITS if edit.applies(tree)]
    return applicable[turn % len(applicable)]


def clean_code(problem: MbppProblem) -> str:
    """The reference solution as the prompt shows it: Unix line ends (the data has Windows ones) and, where that
    leaves the program as it is, no trailing spaces."""
    lines = problem.code.splitlines()
    stripped = "".join(line.rstrip() + "\n" for line in lines)
    # A trailing space can belong to a multi-line string (problem 669's regex): then it stays.
    if ast.dump(_syntax_tree(stripped)) == ast.dump(parse(problem)):
        return stripped
    return "".join(line + "\n" for line in lines)


def edit_prompt(problem: MbppProblem, edit: Edit) -> str:
    """The single-turn request: the task description, the reference code, and the edit to make."""
    return (f"Here is a Python solution to this task: {problem.description}\n\n```python\n{clean_code(problem)}```"
            f"\n\n{edit.request} {_KEEP} {_REPLY}")


def conversation(problem: MbppProblem, edit: Edit) -> list[dict[str, str]]:
    """The two-turn form as chat messages: a reformatting request, its answer (ast.unparse of the reference),
    and the edit asked of that answer."""
    reformatted = ast.unparse(parse(problem))
    return [
        {"role": "user", "content": f"Here is a Python solution to this task: {problem.description}\n\n"
                                    f"```python\n{clean_code(problem)}```\n\n{_REFORMAT}"},
        {"role": "assistant", "content": f"```python\n{reformatted}\n```"},
        {"role": "user", "content": f"Now edit your code. {edit.request} {_KEEP} {_REPLY}"},
    ]


def transcript(messages: list[dict[str, str]]) -> str:
    """A conversation told in one message ("User: ...", "Assistant: ..."), for a prompt that must be a string."""
    return "\n\n".join(f"{message['role'].capitalize()}: {message['content']}" for message in messages)


def examples(split: str = "test", limit: int | None = None, turns: int = 1) -> list[Example]:
    """MBPP edits as task examples: mbpp's (the same ids and tests: setup code and original asserts) with the
    edit's prompt (and for turns=2, metadata["messages"]) and the cleaned reference. metadata["edit"] names
    the edit."""
    if turns not in (1, 2):
        raise ValueError(f"turns must be 1 or 2, got {turns!r}")
    originals = {example.id: example for example in mbpp_examples(split)}
    return [_edited(originals[str(p.task_id)], p, edit_for(p), turns) for p in load_mbpp(split)[:limit]]


def _edited(original: Example, problem: MbppProblem, edit: Edit, turns: int) -> Example:
    if turns == 1:
        return replace(original, prompt=edit_prompt(problem, edit), reference=clean_code(problem),
                       metadata={"edit": edit.name})
    messages = conversation(problem, edit)
    return replace(original, prompt=transcript(messages), reference=clean_code(problem),
                   metadata={"edit": edit.name, "messages": messages})


# The answer repeats the whole function with its additions: a test reference is 44 tokens at the median, 210 at
# the 99th percentile (Qwen2.5's tokenizer), and docstrings or comments can double that. The stop string (the
# closing fence of the one code block asked for) ends a normal answer long before the limit.
MBPP_EDIT = Task("mbpp-edit", "pass@1", examples, tests_pass, stop=("\n```\n",), max_new_tokens=512)
MBPP_EDIT_2TURN = Task("mbpp-edit-2turn", "pass@1", partial(examples, turns=2), tests_pass, stop=("\n```\n",),
                       max_new_tokens=512)

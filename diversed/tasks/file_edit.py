"""Whole-file edits (`file-edit`): a Python file of 6-8 functions and one request about one of them; the answer
is the whole file again, most of it a copy. The input-grounded request a code assistant gets most often, and
the one where copying the input (Predicted Outputs, prompt lookup) pays most.

Files are assembled from HumanEval's canonical solutions and MBPP's reference solutions, each with its own
tests (diversed.tasks.humaneval, diversed.tasks.mbpp): a file holds the units of one split only (HumanEval's
split by task number, MBPP's by task_id), in a fixed pseudo-random order, none defining a name another defines.
Every unit is re-indented to 4 spaces a level first (reindent; the same program), since MBPP's tabs and one- or
two-space levels are an artifact of the data set, not what a user's file looks like (PEP 8), and a model that
copies the file re-indents them unasked, departing from it on every line.
Each file gets two requests (two examples), KINDS in turn, each about one function of the file:
- rename: rename it and every call to it (its tests then call the new name; the old one must be gone);
- parameter: add a keyword parameter `verbose` with default False that prints the result when true;
- document: add a docstring to it alone (type hints where it has a docstring already);
- bug: a bug planted in it (a comparison, an arithmetic operator or an integer constant changed, one its
  tests catch: the sites were found in the sandbox once, by benchmarks/file_edit_bugs.py, and ship
  in data/file-edit/bugs.json); fix it.
Reward: the file in the answer's code block passes every function's original tests in the sandbox (for a
renamed function, its tests with the new name; for a planted bug, the original tests, which the bug fails),
and the request was carried out (the new name defined and the old gone, the parameter with its default, the
docstring or hints there). Example.metadata["original"] is the file as the prompt shows it: the prediction a
user would send (Predicted Outputs).
"""

from __future__ import annotations

import ast
import hashlib
import io
import json
import re
import tokenize
from dataclasses import dataclass
from functools import cache

from diversed.tasks.humaneval import load_humaneval
from diversed.tasks.mbpp import load_mbpp
from diversed.tasks.mbpp_edit import clean_code
from diversed.tasks.offline import check_split, read_text
from diversed.tasks.rewards import code_reward, extract_code
from diversed.tasks.task import Example, Task

SPLITS = ("train", "test")
KINDS = ("rename", "parameter", "document", "bug")
SIZES = (6, 7, 8)  # functions a file holds, by file number in turn
REQUESTS = 2  # examples per file: two requests about two of its functions (ids "split/Na", "split/Nb")
_MBPP_SPLITS = {"train": "train", "test": "test"}


@dataclass(frozen=True)
class Unit:
    """One source problem in a file: its code, its tests (plain asserts, HumanEval's check() called on the
    function), and the function the tests exercise."""

    id: str
    code: str
    tests: str
    function: str


@dataclass(frozen=True)
class EditFile:
    """A file of units and the request about one of them (`target`, an index into units)."""

    id: str
    units: tuple[Unit, ...]
    kind: str
    target: int

    @property
    def function(self) -> str:
        return self.units[self.target].function

    @property
    def split(self) -> str:
        return self.id.split("/")[0]


def units(split: str) -> list[Unit]:
    """Every usable source problem of a split, HumanEval's and MBPP's, in a fixed pseudo-random order (by the
    sha256 of its id)."""
    check_split(split, SPLITS)
    found = [Unit(p.task_id, reindent(p.prompt + p.canonical_solution), f"{p.tests}\n\ncheck({p.entry_point})\n",
                  p.entry_point) for p in load_humaneval(split)]
    for problem in load_mbpp(_MBPP_SPLITS[split]):
        code = reindent(clean_code(problem))
        function = _tested_function(code, problem.tests)
        if function is not None:
            found.append(Unit(f"MBPP/{problem.task_id}", code, "\n".join(filter(None, [problem.setup, *problem.tests])),
                              function))
    return sorted(found, key=lambda unit: hashlib.sha256(unit.id.encode()).hexdigest())


def reindent(code: str) -> str:
    """`code` indented 4 spaces a level: every statement's leading whitespace (tabs, 1, 2 or 3 spaces a level)
    made 4 spaces per block it is in (levels from tokenize's INDENT and DEDENT tokens). A statement's
    continuation lines move with its first line, keeping their place relative to it; a comment line takes the
    indentation of the statement or block it lines up with; lines inside a string are not touched. The program
    stays the same (the same syntax tree). Code that does not tokenize is returned as it is."""
    lines = io.StringIO(code).readlines()
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(code).readline))
    except (tokenize.TokenError, SyntaxError):
        return code

    def width(row: int) -> int:
        line = lines[row - 1]
        return len(line[:len(line) - len(line.lstrip(" \t"))].expandtabs(8))

    fstring_start, fstring_end = getattr(tokenize, "FSTRING_START", None), getattr(tokenize, "FSTRING_END", None)
    indents: dict[int, int] = {}  # line number -> its new indentation (columns)
    inside_string, seen = set(), set()  # lines that begin inside a string; lines whose first token was seen
    levels: dict[int, tuple[int, int]] = {}  # depth -> (old, new) indentation of the latest statement there
    comments: list[int] = []  # comment lines waiting for the next statement
    depth, last_depth, statement, first, fstrings = 0, 0, True, (0, 0), []

    def place_comments(candidates: list[tuple[int, int]]) -> None:
        for row in comments:
            old = width(row)
            match = next((new for before, new in candidates if before == old), None)
            if match is None:  # lines up with nothing: keep its offset from the block it is in
                before, new = max((c for c in candidates if c[0] <= old), default=(0, 0))
                match = new + old - before
            indents[row] = match
        comments.clear()

    for token in tokens:
        kind, (row, column) = token.type, token.start
        if kind == tokenize.INDENT:
            depth += 1
        elif kind == tokenize.DEDENT:
            depth -= 1
        elif kind == tokenize.NEWLINE:
            statement = True
        elif kind == tokenize.ENDMARKER:
            place_comments([levels[d] for d in range(last_depth, -1, -1) if d in levels])
        elif kind != tokenize.NL:
            starts_line = (not fstrings and row not in seen and row not in inside_string
                           and not lines[row - 1][:column].strip(" \t"))
            seen.add(row)
            if kind == tokenize.COMMENT and statement and starts_line:
                comments.append(row)
            elif statement:  # the blocks the previous statement is in, innermost first: what a comment may end
                blocks = [levels[d] for d in range(last_depth, -1, -1) if d in levels]
                first, statement, last_depth = (width(row), 4 * depth), False, depth
                levels[depth] = first
                indents[row] = first[1]
                place_comments([first, *blocks])
            elif starts_line:  # a continuation line
                indents[row] = max(0, width(row) - first[0] + first[1])
        if kind == fstring_start:
            fstrings.append(row)
        elif kind == fstring_end:
            inside_string.update(range(fstrings.pop() + 1, token.end[0] + 1))
        elif kind == tokenize.STRING:
            inside_string.update(range(row + 1, token.end[0] + 1))
    for row, columns in indents.items():
        line = lines[row - 1]
        lines[row - 1] = " " * columns + line.lstrip(" \t")
    return "".join(lines)


def _tested_function(code: str, tests: tuple[str, ...]) -> str | None:
    """The top-level function of `code` that the first assert calls (None: none, or code that is not Python)."""
    try:
        defined = {node.name for node in _parse(code).body if isinstance(node, ast.FunctionDef)}
        called = [node.func.id for node in ast.walk(_parse(tests[0])) if isinstance(node, ast.Call)
                  and isinstance(node.func, ast.Name)]
    except (SyntaxError, IndexError):
        return None
    return next((name for name in called if name in defined), None)


def _defined_names(code: str) -> set[str]:
    """The names a unit's code defines at the top level (functions, classes, variables)."""
    names = set()
    for node in _parse(code).body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return names


@cache
def files(split: str) -> tuple[EditFile, ...]:
    """The split's requests: units taken in order into files of SIZES in turn (a unit that defines a name the
    file already has waits for the next file), and two requests about each file, their kinds KINDS in turn,
    each about the first function the kind fits counted from a place that moves with the file's number (so
    that targets spread over positions), never both about the same one."""
    pending, assembled, made = list(units(split)), [], []
    while pending:
        size = SIZES[len(assembled) % len(SIZES)]
        chosen, names, rest = [], set(), []
        for unit in pending:
            own = _defined_names(unit.code)
            if len(chosen) < size and not own & names:
                chosen.append(unit)
                names |= own
            else:
                rest.append(unit)
        if len(chosen) < min(SIZES):
            break
        pending, number = rest, len(assembled)
        assembled.append(chosen)
        targets = []
        for request in range(REQUESTS):
            kind = KINDS[(REQUESTS * number + request) % len(KINDS)]
            start = number + request * len(chosen) // REQUESTS
            order = [(start + i) % len(chosen) for i in range(len(chosen))]
            target = next((i for i in order if i not in targets and _fits(kind, chosen[i], split)), None)
            if target is not None:
                targets.append(target)
                made.append(EditFile(f"{split}/{number}{'ab'[request]}", tuple(chosen), kind, target))
    return tuple(made)


def _fits(kind: str, unit: Unit, split: str) -> bool:
    if kind == "bug":
        return unit.id in planted_bugs(split)
    if kind == "document":
        return _document_request(unit) is not None
    return True


def _function_node(code: str, name: str) -> ast.FunctionDef:
    return next(node for node in _parse(code).body if isinstance(node, ast.FunctionDef) and node.name == name)


def _document_request(unit: Unit) -> str | None:
    """"docstring" where the function has none, else "hints" where a parameter or the return lacks one."""
    node = _function_node(unit.code, unit.function)
    if ast.get_docstring(node) is None:
        return "docstring"
    arguments = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]
    return "hints" if node.returns is None or any(a.annotation is None for a in arguments) else None


def new_name(name: str) -> str:
    """What a rename request renames a function to."""
    return f"{name}_checked" if not name.endswith("_checked") else f"{name}_v2"


# Planted bugs: the k-th mutable site of the function, in ast.walk order, changed as these say.
_SWAPS = {ast.Lt: "<=", ast.LtE: "<", ast.Gt: ">=", ast.GtE: ">", ast.Eq: "!=", ast.NotEq: "=="}
_SYMBOLS = {ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=", ast.Eq: "==", ast.NotEq: "!=", ast.Add: "+",
            ast.Sub: "-"}


def mutation_sites(code: str, function: str) -> list[tuple[int, int, str]]:
    """Where a bug can be planted in `function`: (start, end, replacement) character spans of `code`, in
    ast.walk order: a single comparison's operator swapped (< to <=, == to !=, ...), + and - swapped, an
    integer constant n made n + 1."""
    offsets = [0]
    for line in code.splitlines(keepends=True):
        offsets.append(offsets[-1] + len(line))

    def at(line: int, column: int) -> int:  # ast columns count UTF-8 bytes
        text = code[offsets[line - 1]:offsets[line]]
        return offsets[line - 1] + len(text.encode()[:column].decode(errors="ignore"))

    sites = []
    for node in ast.walk(_function_node(code, function)):
        if isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in _SWAPS:
            gap = (at(node.left.end_lineno, node.left.end_col_offset),
                   at(node.comparators[0].lineno, node.comparators[0].col_offset))
            sites += _operator_site(code, gap, _SYMBOLS[type(node.ops[0])], _SWAPS[type(node.ops[0])])
        elif isinstance(node, ast.BinOp) and type(node.op) in (ast.Add, ast.Sub):
            gap = (at(node.left.end_lineno, node.left.end_col_offset), at(node.right.lineno, node.right.col_offset))
            symbol = _SYMBOLS[type(node.op)]
            sites += _operator_site(code, gap, symbol, "-" if symbol == "+" else "+")
        elif isinstance(node, ast.Constant) and type(node.value) is int:
            start, end = at(node.lineno, node.col_offset), at(node.end_lineno, node.end_col_offset)
            if code[start:end].isdigit():
                sites.append((start, end, str(node.value + 1)))
    return sites


def _operator_site(code: str, gap: tuple[int, int], symbol: str, replacement: str) -> list[tuple[int, int, str]]:
    """The operator between two operands, where the text between them is only it and spaces (no comment, no
    parenthesis)."""
    start, end = gap
    if code[start:end].strip() != symbol:
        return []
    begin = start + code[start:end].index(symbol)
    return [(begin, begin + len(symbol), replacement)]


def plant(code: str, site: tuple[int, int, str]) -> str:
    start, end, replacement = site
    return code[:start] + replacement + code[end:]


@cache
def planted_bugs(split: str) -> dict[str, int]:
    """Unit id -> the index of the mutation site that its tests catch (data/file-edit/bugs.json)."""
    return json.loads(read_text("file-edit", "bugs.json"))[split]


def file_code(edit_file: EditFile, buggy: bool = True) -> str:
    """The file as the prompt shows it: the units' imports first, then their code, two blank lines apart (with
    the planted bug of a bug request, unless buggy=False)."""
    imports, bodies = [], []
    for i, unit in enumerate(edit_file.units):
        code = unit.code
        if buggy and edit_file.kind == "bug" and i == edit_file.target:
            code = plant(code, mutation_sites(code, unit.function)[planted_bugs(edit_file.split)[unit.id]])
        lines = code.strip("\n").splitlines()
        while lines and re.match(r"(import |from \S+ import )", lines[0]) or lines and not lines[0].strip():
            if lines[0].strip() and lines[0] not in imports:
                imports.append(lines[0])
            lines.pop(0)
        bodies.append("\n".join(lines))
    return "\n".join(imports) + ("\n\n\n" if imports else "") + "\n\n\n".join(bodies) + "\n"


def request(edit_file: EditFile) -> str:
    """The user's request, about the target function."""
    name = edit_file.function
    if edit_file.kind == "rename":
        return f"Rename the function `{name}` to `{new_name(name)}`, and update every call to it."
    if edit_file.kind == "parameter":
        return (f"Add a keyword parameter `verbose` with the default value False to `{name}`: when it is true, "
                f"`{name}` prints its result before returning it; with the default nothing changes.")
    if edit_file.kind == "bug":
        return f"The function `{name}` has a bug: it gives wrong results for some inputs. Fix it."
    if _document_request(edit_file.units[edit_file.target]) == "docstring":
        return f"Add a docstring to `{name}` that says what it does and returns. Change no other function."
    return f"Add type hints to every parameter of `{name}` and to its return value. Change no other function."


def prompt(edit_file: EditFile) -> str:
    return (f"Here is a Python file:\n\n```python\n{file_code(edit_file)}```\n\n{request(edit_file)} Keep everything "
            "else as it is. Reply with the whole updated file in one ```python block.")


def examples(split: str = "test", limit: int | None = None) -> list[Example]:
    """The split's files as task examples: the prompt, the file the request asks for as reference (the
    original for a planted bug, the file as shown otherwise), the tests of every unit (a renamed function's
    with its new name), and metadata: the request's kind, function and the file as shown ("original")."""
    made = []
    for edit_file in files(split)[:limit]:
        tests = []
        for i, unit in enumerate(edit_file.units):
            renamed = edit_file.kind == "rename" and i == edit_file.target
            tests.append(re.sub(rf"\b{unit.function}\b", new_name(unit.function), unit.tests) if renamed
                         else unit.tests)
        made.append(Example(edit_file.id, prompt(edit_file), file_code(edit_file, buggy=False), "\n\n".join(tests),
                            metadata={"kind": edit_file.kind, "function": edit_file.function,
                                      "original": file_code(edit_file), "units": [u.id for u in edit_file.units]}))
    return made


def carried_out(example: Example, code: str) -> bool:
    """Whether the answer's code did what the request asked (its tests say whether it still works)."""
    kind, name = example.metadata["kind"], example.metadata["function"]
    try:
        defined = {node.name: node for node in _parse(code).body if isinstance(node, ast.FunctionDef)}
    except SyntaxError:
        return False
    if kind == "rename":
        return new_name(name) in defined and name not in defined
    node = defined.get(name)
    if node is None:
        return False
    if kind == "parameter":
        arguments = [*node.args.args, *node.args.kwonlyargs]
        defaults = [None] * (len(node.args.args) - len(node.args.defaults)) + [*node.args.defaults,
                                                                             *node.args.kw_defaults]
        return any(a.arg == "verbose" and isinstance(d, ast.Constant) and d.value is False
                   for a, d in zip(arguments, defaults, strict=True))
    if kind == "document" and "docstring" in example.prompt.split("```")[-1]:
        return ast.get_docstring(node) is not None
    if kind == "document":
        arguments = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]
        return node.returns is not None and all(a.annotation is not None for a in arguments)
    return True


def reward(example: Example, completion: str, timeout_s: float = 20) -> float:
    """1.0 when the answer's file passes every unit's tests in the sandbox and carries out the request."""
    code = extract_code(completion)
    if not carried_out(example, code):
        return 0.0
    return code_reward(code, example.tests, None, timeout_s=timeout_s)


def _parse(code: str) -> ast.Module:
    import warnings

    with warnings.catch_warnings():  # regexes written as plain strings ("\d") in the data's own code
        warnings.simplefilter("ignore", SyntaxWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        return ast.parse(code)


# Whole files come back: 6-8 functions, several with HumanEval's docstrings, can take 1,000 tokens and more.
FILE_EDIT = Task("file-edit", "pass@1", examples, reward, stop=("\n```\n",), max_new_tokens=1536)

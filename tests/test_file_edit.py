"""The file-edit task: how its files are assembled, where bugs are planted, and its reward on answers that do
and do not carry out each kind of request. A handful of sandbox runs, skipped where bubblewrap cannot confine
programs."""

import ast
import io
import re
import tokenize

import pytest

from diversed.tasks import get_task
from diversed.tasks.file_edit import (
    FILE_EDIT,
    KINDS,
    SIZES,
    SPLITS,
    carried_out,
    examples,
    file_code,
    files,
    mutation_sites,
    new_name,
    plant,
    planted_bugs,
    reindent,
    reward,
    units,
)
from diversed.tasks.humaneval import load_humaneval
from diversed.tasks.mbpp import load_mbpp
from diversed.tasks.mbpp_edit import clean_code


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the data's regexes in plain strings ("\\w")
def test_files_are_split_by_source_problem_and_hold_distinct_names():
    train, test = files("train"), files("test")
    assert len(test) >= 150 and len(train) >= 140
    sources = [{unit.id for f in split for unit in f.units} for split in (train, test)]
    assert not sources[0] & sources[1]
    for edit_file in test:
        assert len(edit_file.units) in SIZES
        tree = ast.parse(file_code(edit_file, buggy=False))
        names = [node.name for node in tree.body if isinstance(node, ast.FunctionDef)]
        assert len(names) == len(set(names)) and edit_file.function in names
    assert {f.kind for f in test} == set(KINDS)
    assert get_task("file-edit") is FILE_EDIT and FILE_EDIT.metric == "pass@1"


def test_an_example_shows_the_file_and_asks_about_one_function():
    for example in examples("test", limit=8):
        assert example.metadata["original"] in example.prompt
        assert f"`{example.metadata['function']}`" in example.prompt
        if example.metadata["kind"] == "bug":
            assert example.reference != example.metadata["original"]
        else:
            assert example.reference == example.metadata["original"]


def test_mutation_sites_change_one_operator_or_constant():
    code = "def f(a, b):\n    # a < b here\n    return a + b if a < 2 else (b - 1)\n"
    planted = [plant(code, site) for site in mutation_sites(code, "f")]
    assert {line for p in planted for line in p.splitlines()[2:]} == {
        "    return a - b if a < 2 else (b - 1)", "    return a + b if a <= 2 else (b - 1)",
        "    return a + b if a < 3 else (b - 1)", "    return a + b if a < 2 else (b + 1)",
        "    return a + b if a < 2 else (b - 2)"}
    assert all(p.splitlines()[1] == "    # a < b here" for p in planted)


def test_reindent_makes_levels_4_spaces_and_leaves_strings_and_continuations_in_place():
    code = ("def f(a,\n\tb):\n\t# first\n\tif a:\n\t\tx = [1,\n\t\t     2]\n\t\ts = '''one\n\t two'''\n"
            "\t# back out\n\treturn x \\\n\t\t+ [b]\n")
    assert reindent(code) == ("def f(a,\n        b):\n    # first\n    if a:\n        x = [1,\n" + " " * 13 + "2]\n"
                              "        s = '''one\n\t two'''\n    # back out\n    return x \\\n            + [b]\n")
    assert reindent("if a:\n b = 1\n # odd\nc = 2  # keep\n") == "if a:\n    b = 1\n    # odd\nc = 2  # keep\n"
    assert reindent("class A:\n  def f(self):\n    '''Doc\n    more.'''\n    return 1\n") == (
        "class A:\n    def f(self):\n        '''Doc\n    more.'''\n        return 1\n")
    pep8 = "def f(x):\n    # note\n    return [x,\n      x]  # two\n"
    assert reindent(pep8) == pep8 and reindent("def f(:\n") == "def f(:\n"


def _four_spaces_a_level(code: str) -> bool:
    """Whether every block of `code` is indented 4 spaces more than the one it is in."""
    depth = 0
    for token in tokenize.generate_tokens(io.StringIO(code).readline):
        depth += (token.type == tokenize.INDENT) - (token.type == tokenize.DEDENT)
        if token.type == tokenize.INDENT and token.string != "    " * depth:
            return False
    return True


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::SyntaxWarning")  # the data's plain "\d"
def test_every_unit_is_4_space_indented_and_the_same_program_with_the_same_bug_sites():
    for split in SPLITS:
        sources = {p.task_id: p.prompt + p.canonical_solution for p in load_humaneval(split)}
        sources |= {f"MBPP/{p.task_id}": clean_code(p) for p in load_mbpp(split)}
        bugs = planted_bugs(split)
        for unit in units(split):
            source = sources[unit.id]
            assert ast.dump(ast.parse(source)) == ast.dump(ast.parse(unit.code)), unit.id
            assert _four_spaces_a_level(unit.code), unit.id
            if _four_spaces_a_level(source):
                assert unit.code == source, unit.id  # already 4 spaces a level: byte for byte the same
            if unit.id in bugs:  # bugs.json's site index plants the same bug as in the source
                before, after = (mutation_sites(code, unit.function)[bugs[unit.id]] for code in (source, unit.code))
                assert ast.dump(ast.parse(plant(source, before))) == ast.dump(ast.parse(plant(unit.code, after)))


def _answer(example, edit) -> str:
    """The reference file with `edit` applied to the target function's node, as a fenced answer."""
    tree = ast.parse(example.reference)
    node = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == example.metadata["function"])
    edit(node)
    return f"Here it is:\n```python\n{ast.unparse(tree)}\n```\n"


def _add_verbose(node: ast.FunctionDef) -> None:
    node.args.kwonlyargs.append(ast.arg("verbose"))
    node.args.kw_defaults.append(ast.Constant(False))


def _document(node: ast.FunctionDef) -> None:
    node.body.insert(0, ast.Expr(ast.Constant("What it does.")))
    for argument in [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]:
        argument.annotation = argument.annotation or ast.Name("object")
    node.returns = node.returns or ast.Name("object")


def test_the_reward_needs_the_request_carried_out_and_every_test_passing(sandbox):
    by_kind = {}
    for example in examples("test"):
        by_kind.setdefault(example.metadata["kind"], example)
    rename, parameter, document, bug = (by_kind[kind] for kind in KINDS)
    name = rename.metadata["function"]
    renamed = re.sub(rf"\b{name}\b", new_name(name), rename.reference)
    assert reward(rename, f"```python\n{renamed}```\n") == 1.0
    assert reward(rename, f"```python\n{rename.reference}```\n") == 0.0  # not renamed
    assert reward(parameter, _answer(parameter, _add_verbose)) == 1.0
    assert not carried_out(parameter, parameter.reference)
    assert reward(document, _answer(document, _document)) == 1.0
    assert not carried_out(document, document.reference)
    assert reward(bug, f"```python\n{bug.reference}```\n") == 1.0  # fixed
    assert reward(bug, f"```python\n{bug.metadata['original']}```\n") == 0.0  # the planted bug, caught

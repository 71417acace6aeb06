"""The data sets that ship inside the package (GSM8K, MBPP, HumanEval+): their copies, splits, prompts and
rewards. Running sandboxed code costs about 0.1-1 s a program, so only a handful run here."""

import gzip
import json
import shutil
import time
from decimal import Decimal

import pytest

from diversed.tasks import TASKS, get_task
from diversed.tasks.gsm8k import chat_prompt, load_gsm8k, plain_prompt
from diversed.tasks.humanevalplus import load_humaneval_plus
from diversed.tasks.mbpp import load_mbpp
from diversed.tasks.offline import DATA_DIR
from diversed.tasks.rewards import final_number, math_reward

# The sha256 of each uncompressed file, as recorded where the copies were taken (their provenance is in each
# folder's manifest.json).
EXPECTED_SHA256 = {
    ("gsm8k", "train.jsonl"): "17f347dc51477c50d4efb83959dbb7c56297aba886e5544ee2aaed3024813465",
    ("gsm8k", "test.jsonl"): "3730d312f6e3440559ace48831e51066acaca737f6eabec99bccb9e4b3c39d14",
    ("mbpp", "mbpp.jsonl"): "ccf64ceae9c5403bf50a044cb6d505bfd2a2963ee58338ba268fd65beab92a9f",
    ("mbpp", "sanitized-mbpp.json"): "ca95deaa9a01ef0a6f439f88bcf0dd3db3563d22f22aad6cae04ebb9a8d8c8e9",
    ("humanevalplus", "HumanEvalPlus.jsonl"): "42526ec0e7d5f3ee0b06d6ced98f8c8bae3d76519151bfb3d36f79010645bd7f",
}

# --- the packaged copies


def test_manifests_record_the_expected_sha256_and_licenses_ship():
    for (dataset, name), sha256 in EXPECTED_SHA256.items():
        manifest = json.loads((DATA_DIR / dataset / "manifest.json").read_text())
        assert manifest["files"][name]["sha256"] == sha256
        assert (DATA_DIR / dataset / f"{name}.gz").is_file()
    for license_file in ("gsm8k/LICENSE", "mbpp/LICENSE-CC-BY-4.0.txt", "humanevalplus/LICENSE"):
        assert (DATA_DIR / license_file).stat().st_size > 1000
    assert sum(f.stat().st_size for f in DATA_DIR.rglob("*") if f.is_file()) < 3_500_000


def test_split_sizes():
    assert [len(load_gsm8k(split)) for split in ("train", "test")] == [7473, 1319]
    for sanitized, sizes in ((False, [374, 90, 500, 10]), (True, [120, 43, 257, 7])):
        assert [len(load_mbpp(split, sanitized)) for split in ("train", "validation", "test", "prompt")] == sizes
    assert [len(load_humaneval_plus(split)) for split in ("train", "test", "all")] == [123, 41, 164]


def test_splits_are_disjoint():
    train, test = load_gsm8k("train"), load_gsm8k("test")
    assert not {p.id for p in train} & {p.id for p in test}
    assert not {p.question for p in train} & {p.question for p in test}
    for name in ("mbpp", "mbpp-sanitized"):
        task = get_task(name)
        splits = {split: task.examples(split) for split in ("train", "validation", "test", "prompt")}
        ids = [e.id for examples in splits.values() for e in examples]
        prompts = [e.prompt for examples in splits.values() for e in examples]
        assert len(set(ids)) == len(ids) and len(set(prompts)) == len(prompts)
        assert {int(e.id) for e in splits["test"]} <= set(range(11, 511))
        assert {int(e.id) for e in splits["train"]} <= set(range(601, 975))
    train, test = load_humaneval_plus("train"), load_humaneval_plus("test")
    assert all(int(p.task_id.split("/")[1]) % 4 == 0 for p in test)
    assert not {p.task_id for p in train} & {p.task_id for p in test}
    # The same held-out problems as the humaneval task.
    assert [p.task_id for p in test] == [e.id for e in get_task("humaneval").examples("test")]


@pytest.mark.parametrize("load, split", [
    (load_gsm8k, "validation"), (load_mbpp, "dev"), (load_humaneval_plus, "validation")])
def test_unknown_split_is_refused(load, split):
    with pytest.raises(ValueError, match=f"unknown split '{split}': choose from"):
        load(split)


@pytest.mark.parametrize("name", ["gsm8k", "gsm8k-plain", "mbpp", "mbpp-sanitized", "humaneval-plus"])
def test_tasks_refuse_an_unknown_split(name):
    with pytest.raises(ValueError, match="unknown split 'valid'"):
        get_task(name).examples("valid")


def _copy_gsm8k(tmp_path, contents: bytes | None = None):
    """A GSM8K folder under tmp_path: the real manifest, and test.jsonl.gz (the real one, or these bytes)."""
    (tmp_path / "gsm8k").mkdir()
    shutil.copy(DATA_DIR / "gsm8k" / "manifest.json", tmp_path / "gsm8k")
    target = tmp_path / "gsm8k" / "test.jsonl.gz"
    if contents is None:
        shutil.copy(DATA_DIR / "gsm8k" / "test.jsonl.gz", target)
    else:
        target.write_bytes(contents)
    return tmp_path


def test_a_good_copy_elsewhere_loads(tmp_path):
    assert len(load_gsm8k("test", root=_copy_gsm8k(tmp_path))) == 1319


def test_a_changed_copy_is_refused(tmp_path):
    text = gzip.decompress((DATA_DIR / "gsm8k" / "test.jsonl.gz").read_bytes()).replace(b"#### 18", b"#### 19", 1)
    root = _copy_gsm8k(tmp_path, gzip.compress(text))
    with pytest.raises(ValueError, match=r"test\.jsonl\.gz: sha256 of the uncompressed contents is [0-9a-f]{64}, "
                                         r"expected 3730d312f6e3"):
        load_gsm8k("test", root=root)


def test_a_damaged_copy_is_refused(tmp_path):
    truncated = (DATA_DIR / "gsm8k" / "test.jsonl.gz").read_bytes()[:1000]
    with pytest.raises(ValueError, match=r"test\.jsonl\.gz: damaged"):
        load_gsm8k("test", root=_copy_gsm8k(tmp_path, truncated))


def test_tasks_are_registered():
    assert {"gsm8k", "gsm8k-plain", "mbpp", "mbpp-sanitized", "humaneval-plus", "humaneval"} <= set(TASKS)
    for name in ("gsm8k", "gsm8k-plain", "mbpp", "mbpp-sanitized", "humaneval-plus"):
        assert get_task(name).max_new_tokens == 512


# --- GSM8K


@pytest.mark.parametrize("completion, expected", [
    ("Janet sells 16 - 3 - 4 = 9 eggs.\nShe makes 9 * 2 = $18 every day.\n#### 18", "18"),
    ("#### 5 apples, not 7", "5"),
    ("####18", "18"),
    ("#### 1,080", "1080"),
    ("The answer is 18.", "18"),
    ("The answer is $18.", "18"),
    ("So the answer is: $1,234.50", "1234.5"),
    ("The answer is **42**.", "42"),
    ("**The answer is 42.**", "42"),
    ("The final answer is $\\boxed{18}$.", "18"),
    ("Therefore, the answer is \\boxed{18}.", "18"),
    ("\\boxed{-7}", "-7"),
    ("The answer is 3.0", "3"),
    ("The answer is -3.", "-3"),
    ("The answer is \u22123.", "-3"),  # a Unicode minus sign
    ("The answer is 5%.", "5"),
    ("The answer is 10. Wait: 16 - 3 - 4 = 9 and 9 * 2 = 18. The answer is 18.", "18"),  # the last one stated
    ("The answer is 18. This answer is right since 9 * 2 = 18, not 20.", "18"),  # "answer is right" states none
    ("The answer is eighteen, since 9 * 2 = 18.", "18"),  # no number stated: the last one
    ("She makes $18 every day at the market.", "18"),
    ("First 3, then 4, so 12.", "12"),
    ("In 2 hours she earns $36.00.", "36"),
    ("It costs 1,000,000 dollars.", "1000000"),
    ("Total: 12,345.67", "12345.67"),
    ("1,2,3", "3"),  # not a thousands group
    ("5-3=2", "2"),
    ("The drop is 5-3, so 2", "2"),
    ("It is 5-3", "3"),  # a minus after a digit is not a sign
    ("I don't know.", None),
    ("version x2", None),
    ("", None),
])
def test_final_number(completion, expected):
    assert final_number(completion) == (None if expected is None else Decimal(expected))


def test_every_reference_answer_parses():
    for split in ("train", "test"):
        for problem in load_gsm8k(split):
            answer = problem.solution.rpartition("####")[2].strip().replace(",", "")
            assert final_number(problem.solution) == Decimal(answer), problem.id
            assert math_reward(f"The answer is {answer}.", problem.solution) == 1.0


def test_gsm8k_prompts_and_reward():
    [problem] = load_gsm8k("test")[:1]
    [chat] = get_task("gsm8k").examples("test", limit=1)
    [plain] = get_task("gsm8k-plain").examples("test", limit=1)
    assert chat.id == plain.id == "test/0" and chat.reference == plain.reference == problem.solution
    assert chat.prompt == chat_prompt(problem.question) and "The answer is N." in chat.prompt
    assert plain.prompt == plain_prompt(problem.question) == f"Question: {problem.question}\n\nAnswer:"
    assert get_task("gsm8k-plain").stop == ("\n\nQuestion:",) and get_task("gsm8k").stop == ()
    task = get_task("gsm8k")
    assert task.metric == "accuracy"
    assert task.reward(chat, "16 - 3 - 4 = 9 eggs, 9 * 2 = 18 dollars. The answer is $18.") == 1.0
    assert task.reward(chat, "16 - 3 - 4 = 9 eggs. The answer is 9.") == 0.0
    assert task.reward(chat, "I cannot tell.") == 0.0


# --- MBPP


def test_mbpp_prompt_and_tests():
    [example] = get_task("mbpp").examples("test", limit=1)
    assert example.id == "11" and example.prompt.startswith("You are an expert Python programmer")
    assert "remove first and last occurrence" in example.prompt and 'assert remove_Occ("hello","l") == "heo"' in \
        example.prompt
    assert example.tests.count("assert ") == 3
    [with_setup] = [e for e in get_task("mbpp").examples("test") if e.id == "367"]
    assert with_setup.tests.startswith("root = Node(1)")  # test_setup_code first
    [with_imports] = [e for e in get_task("mbpp-sanitized").examples("test") if e.id == "82"]
    assert with_imports.tests.startswith("import math\n")  # test_imports first


@pytest.mark.parametrize("name, split, ids", [
    ("mbpp", "test", ("11", "367")),  # 367 needs its test_setup_code
    ("mbpp", "train", ("601",)),
    ("mbpp-sanitized", "test", ("82",)),  # needs its test_imports
])
def test_mbpp_reference_solutions_pass(name, split, ids):
    task = get_task(name)
    for example in (e for e in task.examples(split) if e.id in ids):
        assert task.reward(example, f"Here:\n```python\n{example.reference}\n```\n") == 1.0, example.id


def test_mbpp_wrong_solution_fails():
    task = get_task("mbpp")
    [example] = task.examples("test", limit=1)
    assert task.reward(example, "```python\ndef remove_Occ(s, ch):\n    return s.replace(ch, '', 1)\n```") == 0.0


# --- HumanEval+


def test_humaneval_plus_canonical_solutions_pass():
    task = get_task("humaneval-plus")
    # 0: exact outputs; 4: float outputs within atol; 32 (find_zero): any zero of the polynomial.
    for example in (e for e in task.examples("test") if e.id in ("HumanEval/0", "HumanEval/4", "HumanEval/32")):
        assert task.reward(example, f"```python\n{example.reference}```\n") == 1.0, example.id


def test_humaneval_plus_runs_the_plus_inputs():
    plus, base = get_task("humaneval-plus"), get_task("humaneval")
    [example] = plus.examples("test", limit=1)
    [original] = base.examples("test", limit=1)
    assert example.id == original.id == "HumanEval/0" and example.prompt == original.prompt
    body = example.reference.removeprefix(example.metadata["code_prompt"])
    # Right on HumanEval's own tests (lists of at most 6 numbers), wrong on longer plus inputs.
    shortcut = "    if len(numbers) > 6:\n        return False\n" + body
    assert base.reward(original, shortcut) == 1.0
    assert plus.reward(example, shortcut) == 0.0
    assert plus.reward(example, "    return False\n") == 0.0


def test_humaneval_plus_stops_a_stuck_candidate_at_its_input_time_limit():
    task = get_task("humaneval-plus")
    [example] = task.examples("test", limit=1)
    start = time.monotonic()
    assert task.reward(example, "    while True:\n        pass\n") == 0.0
    assert time.monotonic() - start < 10  # about 1 s (the per-input limit), far below the whole check's limit

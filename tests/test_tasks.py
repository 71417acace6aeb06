"""Tasks and rewards: HumanEval offline, the hub loaders on fixtures, user JSONL files, and the reward
functions on hand-made examples. Nothing here reaches the network."""

import json

import pytest

from diversed.tasks import TASKS, get_task
from diversed.tasks.humaneval import chat_prompt, load_humaneval
from diversed.tasks.rewards import code_reward, extract_code, math_reward, rouge2_reward

# --- rewards


def test_extract_code_takes_the_python_block_or_the_raw_text():
    assert extract_code("Here it is:\n```python\nx = 1\n```\nDone.") == "x = 1\n"
    assert extract_code("```\nx = 2\n```") == "x = 2\n"
    assert extract_code("```bash\nls\n```\n```py\nx = 3\n```") == "x = 3\n"
    assert extract_code("```\n$ run\n```\n```python\nx = 6\n```") == "x = 6\n"  # python first
    assert extract_code("```python\nx = 4\n") == "x = 4\n"  # cut off before the closing fence
    assert extract_code("x = 5\n") == "x = 5\n"


def test_extract_code_completes_a_function_body_with_the_prompt():
    prompt = "def helper():\n    pass\n\n\ndef add(a, b):\n    \"\"\"Sum.\"\"\"\n"
    assert extract_code("    return a + b\n", prompt) == prompt + "    return a + b\n"
    whole = "```python\ndef add(a, b):\n    return a + b\n```"
    assert extract_code(whole, prompt) == "def add(a, b):\n    return a + b\n"
    assert extract_code(whole, prompt, entry_point="other").startswith(prompt)


@pytest.mark.parametrize(("program", "passes"), [
    ("import sys\nsys.exit(0)\n", False),  # exits with status 0 before the tests
    ("import os\ndef add(a, b):\n    os._exit(0)\n", False),  # ... or while they run
    ("def add(a, b):\n    return a + b\nif __name__ == '__main__':\n    import sys\n    sys.exit(1)\n", True),
    ("def add(a, b):\n    return a + b\nif __name__ == '__main__':\n    print(input())\n", True),
    # The program's module is importable by its name: dataclasses and pickle work as they do in a script.
    ("import dataclasses, pickle\n@dataclasses.dataclass\nclass P:\n    x: 'int'\n"
     "def add(a, b):\n    return pickle.loads(pickle.dumps(P(a + b))).x\n", True),
])
def test_code_reward_counts_only_tests_run_to_their_end_and_skips_main_blocks(program, passes):
    assert code_reward(program, "assert add(1, 2) == 3", None) == float(passes)


def test_code_reward_runs_the_tests():
    program = "def add(a, b):\n    return a + b\n"
    assert code_reward(program, "assert add(1, 2) == 3", None) == 1.0
    assert code_reward(program, "assert add(1, 2) == 4", None) == 0.0
    check = "def check(candidate):\n    assert candidate(2, 2) == 4\n"
    assert code_reward(program, check, "add") == 1.0
    assert code_reward("def add(a, b):\n    return a - b\n", check, "add") == 0.0
    assert code_reward("def add(a, b):\n    while True:\n        pass\n", "assert add(1, 2) == 3", None,
                       timeout_s=1) == 0.0


@pytest.mark.parametrize("completion, reference, expected", [
    ("So she has 72 apples.\n#### 72", "She sold 48 + 24 = 72.\n#### 72", 1.0),
    ("The answer is 72.", "#### 72", 1.0),
    ("It costs $1,234.", "#### 1234", 1.0),
    ("72.0", "72", 1.0),
    ("#### 5 apples, not 7", "5", 1.0),  # after ####: the first number
    ("First 3, then 4, so 12.", "#### 12", 1.0),  # no ####: the last number
    ("-3", "#### -3", 1.0),
    ("The answer is 71.", "#### 72", 0.0),
    ("I don't know.", "#### 72", 0.0),
])
def test_math_reward(completion, reference, expected):
    assert math_reward(completion, reference) == expected


def test_rouge2_reward():
    assert rouge2_reward("the cat sat on the mat", "the cat sat on the mat") == pytest.approx(1.0)
    assert rouge2_reward("dogs bark loudly", "the cat sat on the mat") == 0.0
    assert rouge2_reward("cats running fast", "cat runs fast") == pytest.approx(1.0)  # stemmed
    long = "the cat sat on the mat and then it went to sleep for a very long time"
    assert rouge2_reward(long, "the cat sat", max_words=3) == pytest.approx(1.0)
    assert rouge2_reward(long, "the cat sat") < 0.5


# --- HumanEval (offline)


def test_humaneval_split_and_examples():
    task = get_task("humaneval")
    assert (task.metric, task.max_new_tokens) == ("pass@1", 512)
    test, train = task.examples("test"), task.examples("train")
    assert (len(test), len(train)) == (41, 123)
    assert all(int(e.id.split("/")[1]) % 4 == 0 for e in test)
    assert [e.id for e in task.examples("test", limit=2)] == ["HumanEval/0", "HumanEval/4"]
    problem = load_humaneval("test")[0]
    assert test[0].prompt == chat_prompt(problem) and test[0].entry_point == problem.entry_point


def test_humaneval_canonical_solutions_pass_and_wrong_ones_fail():
    task = get_task("humaneval")
    for example in task.examples("test", limit=3):
        body = example.reference.removeprefix(example.metadata["code_prompt"])
        assert task.reward(example, f"Sure:\n```python\n{example.reference}```\n") == 1.0  # chat style
        assert task.reward(example, body) == 1.0  # the body alone: the header is put in front
        assert task.reward(example, "    return None\n") == 0.0


# --- hub data sets, on fixtures with their real column names


HUB_ROWS = {
    "abisee/cnn_dailymail": [
        {"id": "abc123", "article": "The council approved the new park on Monday after a long debate.",
         "highlights": "Council approves new park after long debate."}],
    "EdinburghNLP/xsum": [
        {"id": "3510", "document": "Heavy rain flooded the town centre overnight.",
         "summary": "Heavy rain has flooded the town centre."}],
}


@pytest.fixture
def fake_hub(monkeypatch):
    """datasets.load_dataset answered from HUB_ROWS; records what it was asked."""
    datasets = pytest.importorskip("datasets")
    calls = []

    def load_dataset(path, name=None, split=None):
        calls.append((path, name, split))
        return datasets.Dataset.from_list(HUB_ROWS[path])

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    return calls


@pytest.mark.parametrize("name, hub_id, config", [("cnn_dailymail", "abisee/cnn_dailymail", "3.0.0"),
                                                  ("xsum", "EdinburghNLP/xsum", None)])
def test_summaries(fake_hub, name, hub_id, config):
    task = get_task(name)
    [example] = task.examples("test")
    assert fake_hub == [(hub_id, config, "test")]
    assert example.id == HUB_ROWS[hub_id][0]["id"] and example.prompt.startswith("Summarize")
    assert task.metric == "rouge2"
    assert task.reward(example, example.reference) == pytest.approx(1.0)
    assert task.reward(example, "Something else entirely.") == 0.0


def test_xsum_cuts_the_summary_to_32_words(fake_hub):
    task = get_task("xsum")
    [example] = task.examples("test")
    padded = example.reference + " and" * 40 + " " + example.reference
    assert task.reward(example, padded) == pytest.approx(rouge2_reward(example.reference + " and" * 25,
                                                                       example.reference))


def test_offline_hub_task_fails_clearly(monkeypatch):
    datasets = pytest.importorskip("datasets")

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'EdinburghNLP/xsum' on the Hub")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(RuntimeError, match="EdinburghNLP/xsum.*Hugging Face hub.*jsonl:PATH"):
        get_task("xsum").examples("test")


def test_unknown_task():
    assert set(TASKS) == {"humaneval", "humaneval-plus", "mbpp", "mbpp-sanitized", "mbpp-edit", "mbpp-edit-2turn",
                          "file-edit", "gsm8k", "gsm8k-plain", "cnn_dailymail", "xsum"}
    with pytest.raises(ValueError, match="unknown task 'nope'"):
        get_task("nope")


# --- user JSONL tasks


def _write(tmp_path, rows, name="task.jsonl") -> str:
    path = tmp_path / name
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return f"jsonl:{path}"


def test_jsonl_code_task(tmp_path):
    name = _write(tmp_path, [
        {"id": "sq", "prompt": "Write square(x).", "entry_point": "square", "split": "test", "difficulty": 1,
         "tests": "def check(candidate):\n    assert candidate(3) == 9\n"},
        {"prompt": "Write cube(x).", "tests": "assert cube(2) == 8", "split": "train"},
    ])
    task = get_task(name)
    assert (task.name, task.metric, task.max_new_tokens) == (name, "pass@1", 512)
    [square] = task.examples("test")
    assert square.id == "sq" and square.metadata == {"split": "test", "difficulty": 1}
    assert task.reward(square, "```python\ndef square(x):\n    return x * x\n```") == 1.0
    assert task.reward(square, "def square(x):\n    return x + x\n") == 0.0
    [cube] = task.examples("train")
    assert cube.id == "2" and task.reward(cube, "def cube(x):\n    return x ** 3\n") == 1.0
    assert len(task.examples("all")) == 2


def test_jsonl_metric_inference_and_choice(tmp_path):
    math = get_task(_write(tmp_path, [{"prompt": "2+2?", "reference": 4},
                                      {"prompt": "1+1?", "reference": "#### 2"}]))
    assert math.metric == "accuracy"
    assert [math.reward(e, "So #### 4") for e in math.examples()] == [1.0, 0.0]
    summary = get_task(_write(tmp_path, [{"prompt": "Summarize: ...", "reference": "a cat sat"}]))
    assert summary.metric == "rouge2"
    assert summary.reward(summary.examples()[0], "a cat sat") == pytest.approx(1.0)
    chosen = get_task(_write(tmp_path, [{"prompt": "Year?", "reference": "1999", "metric": "rouge2"}]))
    assert chosen.metric == "rouge2"
    # A line without a split belongs to every split.
    split = get_task(_write(tmp_path, [{"prompt": "a", "reference": "1", "split": "train"},
                                       {"prompt": "b", "reference": "2"}]))
    assert [e.prompt for e in split.examples("test")] == ["b"]
    assert [e.prompt for e in split.examples("train", limit=1)] == ["a"]


@pytest.mark.parametrize("rows, error", [
    ([{"prompt": "a", "reference": "1"}, "{not json", {"prompt": "c", "reference": "3"}],
     r"task.jsonl:2: not valid JSON"),
    ([{"prompt": "a", "reference": "1"}, "", {"reference": "3"}], r"task.jsonl:3: missing 'prompt'"),
    ([{"prompt": "a"}], r"task.jsonl:1: missing 'reference'"),
    ([{"prompt": "a", "tests": "assert True"}, {"prompt": "b", "reference": "1"}],
     r"task.jsonl:2: missing 'tests'"),
    (["[1, 2]"], r"task.jsonl:1: expected a JSON object"),
    ([{"prompt": 5, "reference": "1"}], r"task.jsonl:1: 'prompt' has type int"),
    ([{"prompt": "a", "reference": "1", "metric": "bleu"}], r"unknown metric 'bleu'"),
    ([{"prompt": "a", "reference": "1", "metric": "rouge2"},
      {"prompt": "b", "reference": "1", "metric": "accuracy"}], r"one metric per file"),
    ([""], r"no examples"),
])
def test_jsonl_errors(tmp_path, rows, error):
    with pytest.raises(ValueError, match=error):
        get_task(_write(tmp_path, rows))


def test_jsonl_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="task file not found"):
        get_task(f"jsonl:{tmp_path / 'absent.jsonl'}")

"""Tasks read from the Hugging Face hub with the datasets library (online users only: no PyPI package
ships these data sets). Splits are the hub's own ("train", "test", and "validation" where there is one).

- mbpp: google-research-datasets/mbpp "full"; pass@1 on its assert tests.
- gsm8k: openai/gsm8k "main"; accuracy of the final number.
- cnn_dailymail: abisee/cnn_dailymail "3.0.0"; ROUGE-2 against the highlights.
- xsum: EdinburghNLP/xsum; ROUGE-2 against the one-sentence summary, the completion cut to 32 words.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from diversed.tasks.task import Example, Task, number_match, rouge2, tests_pass


def _mbpp(row: dict, default_id: str) -> Example:
    tests = "\n".join(row["test_list"])
    program_tests = "\n".join(filter(None, [row.get("test_setup_code"), tests]))
    prompt = (f"You are an expert Python programmer, and here is your task: {row['text']} Your code should "
              f"pass these tests:\n\n{tests}\n\nReply with the code in one ```python block.")
    return Example(str(row["task_id"]), prompt, row["code"], program_tests)


def _gsm8k(row: dict, default_id: str) -> Example:
    prompt = (f"{row['question']}\n\nSolve the problem step by step. End your reply with a line of the form "
              "\"#### <number>\" that gives the final answer.")
    return Example(default_id, prompt, row["answer"])


def _cnn_dailymail(row: dict, default_id: str) -> Example:
    return Example(row["id"], f"Summarize the following news article in three sentences.\n\n{row['article']}",
                   row["highlights"])


def _xsum(row: dict, default_id: str) -> Example:
    return Example(row["id"], f"Summarize the following article in one sentence.\n\n{row['document']}",
                   row["summary"])


def _examples(hub_id: str, config: str | None, to_example: Callable[[dict, str], Example],
              split: str = "test", limit: int | None = None) -> list[Example]:
    try:
        import datasets
    except ImportError:
        raise ImportError(f"{hub_id} is read with the datasets library: pip install datasets") from None
    try:
        rows = datasets.load_dataset(hub_id, config, split=split if limit is None else f"{split}[:{limit}]")
    except OSError as e:  # ConnectionError and the hub's not-found errors are OSErrors
        raise RuntimeError(f"could not load {hub_id} (split {split!r}): it needs the Hugging Face hub or a "
                           f"copy in the local datasets cache; offline, use a jsonl:PATH task ({e})") from e
    return [to_example(row, f"{split}/{i}") for i, row in enumerate(rows)]


# partial(_examples, ...) is examples(split="test", limit=None) for one data set.
MBPP = Task("mbpp", "pass@1", partial(_examples, "google-research-datasets/mbpp", "full", _mbpp), tests_pass,
            max_new_tokens=512)
GSM8K = Task("gsm8k", "accuracy", partial(_examples, "openai/gsm8k", "main", _gsm8k), number_match,
             max_new_tokens=256)
CNN_DAILYMAIL = Task("cnn_dailymail", "rouge2",
                     partial(_examples, "abisee/cnn_dailymail", "3.0.0", _cnn_dailymail), rouge2,
                     max_new_tokens=128)
XSUM = Task("xsum", "rouge2", partial(_examples, "EdinburghNLP/xsum", None, _xsum),
            partial(rouge2, max_words=32), max_new_tokens=64)

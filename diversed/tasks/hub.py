"""Tasks read from the Hugging Face hub with the datasets library (online users only: no PyPI package
ships these data sets). Splits are the hub's own ("train", "test", and "validation" where there is one).
GSM8K and MBPP ship inside the package instead (diversed.tasks.gsm8k, diversed.tasks.mbpp).

- cnn_dailymail: abisee/cnn_dailymail "3.0.0"; ROUGE-2 against the highlights.
- xsum: EdinburghNLP/xsum; ROUGE-2 against the one-sentence summary, the completion cut to 32 words.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from diversed.tasks.task import Example, Task, rouge2


def _cnn_dailymail(row: dict) -> Example:
    return Example(row["id"], f"Summarize the following news article in three sentences.\n\n{row['article']}",
                   row["highlights"])


def _xsum(row: dict) -> Example:
    return Example(row["id"], f"Summarize the following article in one sentence.\n\n{row['document']}",
                   row["summary"])


def _examples(hub_id: str, config: str | None, to_example: Callable[[dict], Example],
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
    return [to_example(row) for row in rows]


# partial(_examples, ...) is examples(split="test", limit=None) for one data set.
CNN_DAILYMAIL = Task("cnn_dailymail", "rouge2",
                     partial(_examples, "abisee/cnn_dailymail", "3.0.0", _cnn_dailymail), rouge2,
                     max_new_tokens=128)
XSUM = Task("xsum", "rouge2", partial(_examples, "EdinburghNLP/xsum", None, _xsum),
            partial(rouge2, max_words=32), max_new_tokens=64)

"""GSM8K (grade-school math word problems, MIT), read offline from the copy in diversed/tasks/data/gsm8k.

Splits: "train" (7,473) and "test" (1,319), as released. Reward: the final number of the completion equals the
reference's (diversed.tasks.rewards.final_number: after "####", "The answer is" or \\boxed{, else the last one).

Two prompt forms:
- gsm8k: the question and an instruction to end with "The answer is N." For instruct models, which get the
  prompt as the user turn of their chat template; the end of the turn (EOS) ends the completion.
- gsm8k-plain: the paper's "Question: {question}\\n\\nAnswer:", for base models (or `--no-chat`); it stops at
  "\\n\\nQuestion:", where a base model starts inventing the next problem.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from diversed.tasks.offline import DATA_DIR, check_split, read_text
from diversed.tasks.task import Example, Task, number_match

SPLITS = ("train", "test")


@dataclass(frozen=True)
class MathProblem:
    """A word problem and its worked solution, which ends with "#### <answer>"."""

    id: str  # "<split>/<row number>", as the hub copy's default ids
    question: str
    solution: str


@functools.cache
def load_gsm8k(split: str = "test", root: Path = DATA_DIR) -> tuple[MathProblem, ...]:
    """GSM8K problems of one split, in file order (read and checked once, then cached)."""
    check_split(split, SPLITS)
    rows = map(json.loads, read_text("gsm8k", f"{split}.jsonl", root).splitlines())
    return tuple(MathProblem(f"{split}/{i}", row["question"], row["answer"]) for i, row in enumerate(rows))


def plain_prompt(question: str) -> str:
    """The paper's prompt."""
    return f"Question: {question}\n\nAnswer:"


def chat_prompt(question: str) -> str:
    """The user message for an instruct model: the answer line makes the final number easy to find."""
    return (f"{question}\n\nSolve the problem step by step. End your reply with a line of the form "
            "\"The answer is N.\", where N is the final answer as a number.")


def examples(split: str = "test", limit: int | None = None, plain: bool = False) -> list[Example]:
    """GSM8K as task examples: the prompt (chat_prompt, or plain_prompt when plain) and the worked solution as
    reference."""
    prompt = plain_prompt if plain else chat_prompt
    return [Example(p.id, prompt(p.question), p.solution) for p in load_gsm8k(split)[:limit]]


GSM8K = Task("gsm8k", "accuracy", examples, number_match, max_new_tokens=512)
GSM8K_PLAIN = Task("gsm8k-plain", "accuracy", partial(examples, plain=True), number_match,
                   stop=("\n\nQuestion:",), max_new_tokens=512)

"""Task rewards R(y) (docs/algorithm.md section 4.3): unit tests for code, the final number for math, ROUGE-2 for
summaries. Each maps a completion to a float in [0, 1]."""

from __future__ import annotations

import functools
import re
import secrets
from decimal import Decimal

from diversed.tasks.sandbox import run_code

# A fenced block: its language tag and body, to the closing fence or the end (generation cut off).
_FENCED_BLOCK = re.compile(r"^[ \t]*```[ \t]*(\w*)[^\n]*\n(.*?)(?:^[ \t]*```|\Z)", re.DOTALL | re.MULTILINE)
# A number: thousands groups only in well-formed "1,234,567" (so "1,2,3" reads as three numbers), an optional "$"
# and minus sign ("-" or U+2212), but no minus after a digit or letter ("5-3" is 5 and 3) and no number glued to
# a letter or a dot ("x2", ".5").
_NUMBER_PATTERN = r"(?<![A-Za-z0-9_.])[-\u2212]?\$?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?"
_NUMBER = re.compile(_NUMBER_PATTERN)
# A stated answer: "####" (GSM8K's own format), "(the final) answer is" or LaTeX's \boxed{, then the number
# within a few non-alphanumeric characters (": $", " **"), so "This answer is right because 3 + 4" states none.
_STATED_ANSWER = re.compile(rf"(?:####|answer is|\\boxed\{{)[^A-Za-z0-9]{{0,12}}?({_NUMBER_PATTERN})",
                            re.IGNORECASE)
_PLAIN_NUMBER = str.maketrans({",": None, "$": None, "\u2212": "-"})
_LAST_DEF = re.compile(r"^def\s+(\w+)\s*\(", re.MULTILINE)


def code_reward(program: str, tests: str, entry_point: str | None, *, timeout_s: float = 10,
                memory_mb: int = 1024) -> float:
    """1.0 when the program followed by the tests runs to their end without error in the sandbox, else 0.0.

    HumanEval style: tests define check(candidate), called here as check(entry_point). Without an entry
    point (MBPP style) the tests are plain asserts. As in the official harnesses, the program does not run
    as __main__ (its `if __name__ == "__main__":` block, which may exit early or wait for input, is
    skipped), and it passes only if the tests reached their end: a program that exits with status 0
    before them (sys.exit(0), os._exit(0)) fails.
    """
    call = f"\n\ncheck({entry_point})\n" if entry_point else "\n"
    reached = f"tests passed {secrets.token_hex(16)}"  # unguessable: only the end of the tests prints it
    result = run_code(f"{program}\n\n{tests}{call}\nprint({reached!r})\n", timeout_s=timeout_s, memory_mb=memory_mb,
                      run_name="candidate")
    return float(result.passed and reached in result.stdout)


def extract_code(completion: str, prompt: str | None = None, entry_point: str | None = None) -> str:
    """The program in a completion: its first ```python fenced block, else its first untagged one, else the
    raw text.

    prompt: code that the completion continues (a HumanEval function header and docstring). When the code
    does not define the entry point (default: the last function the prompt defines), it is a function
    body, and the prompt is put in front of it.
    """
    blocks = _FENCED_BLOCK.findall(completion)
    bodies = [body for tag, body in blocks if tag.lower() in ("python", "py", "python3")]
    bodies += [body for tag, body in blocks if not tag]
    code = bodies[0] if bodies else completion
    if prompt is not None:
        names = _LAST_DEF.findall(prompt)
        entry_point = entry_point or (names[-1] if names else None)
        if entry_point and not re.search(rf"^\s*def\s+{re.escape(entry_point)}\s*\(", code, re.MULTILINE):
            code = prompt + code
    return code


def final_number(text: str) -> Decimal | None:
    """The answer number of a text: the number of its last stated answer ("#### 72", "The answer is $1,234.",
    "\\boxed{72}"), else its last number; None when there is none. "$" and commas are dropped."""
    stated = _STATED_ANSWER.findall(text)
    numbers = stated or _NUMBER.findall(text)
    return Decimal(numbers[-1].translate(_PLAIN_NUMBER)) if numbers else None


def is_number(text: str) -> bool:
    """Whether a text (its part after "####" if there is one) is a single number: "72", "$1,234.5"."""
    return _NUMBER.fullmatch(text.rpartition("####")[2].strip()) is not None


def math_reward(completion: str, reference: str) -> float:
    """GSM8K: 1.0 when the completion's final number equals the reference's, as numbers (72 == 72.0 == $72)."""
    answer, expected = final_number(completion), final_number(reference)
    return float(answer is not None and answer == expected)


def rouge2_reward(completion: str, reference: str, *, max_words: int | None = None) -> float:
    """ROUGE-2 F1 (with stemming) of the completion, cut to its first max_words words, against the
    reference. XSum uses max_words=32."""
    if max_words is not None:
        completion = " ".join(completion.split()[:max_words])
    return _rouge2_scorer().score(reference, completion)["rouge2"].fmeasure


@functools.cache
def _rouge2_scorer():
    from rouge_score import rouge_scorer  # imported on first use: it pulls in nltk

    return rouge_scorer.RougeScorer(["rouge2"], use_stemmer=True)

"""What a task is: examples (prompts with references or tests) and a reward for a completion."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from diversed.tasks.rewards import code_reward, extract_code, math_reward, rouge2_reward


@dataclass(frozen=True)
class Example:
    """One prompt of a task.

    prompt: the user message for an instruct model. reference: the expected answer or summary (for code,
    a correct program). tests: unit tests for code tasks; with entry_point, HumanEval style (they define
    check(candidate)). metadata["code_prompt"], when present, is code the completion may continue (a
    HumanEval function header), put in front of a completion that does not define the entry point.
    metadata["messages"], when present, is the prompt as a conversation (chat messages) for a chat template.
    """

    id: str
    prompt: str
    reference: str | None = None
    tests: str | None = None
    entry_point: str | None = None
    metadata: dict = field(default_factory=dict)

    def prompt_for(self, chat: bool) -> str | list[dict]:
        """The prompt as a model takes it: the conversation for a chat template where there is one."""
        return self.metadata.get("messages", self.prompt) if chat else self.prompt


@dataclass(frozen=True)
class Task:
    """A named task: examples(split, limit=None) -> list[Example], reward(example, completion) -> float in
    [0, 1], the metric that averaging the reward gives, and generation defaults."""

    name: str
    metric: str  # "pass@1", "accuracy" or "rouge2"
    examples: Callable[..., list[Example]]
    reward: Callable[[Example, str], float]
    stop: tuple[str, ...] = ()
    max_new_tokens: int = 128


def predicted_outputs(task_name: str, examples: Sequence[Example]) -> list[str]:
    """Each example's input text (metadata["original"]: the file a whole-file edit returns with a change) as
    its answer's predicted output (Predicted Outputs); ValueError, naming the task, where it has none."""
    if any("original" not in e.metadata for e in examples):
        raise ValueError(f"task {task_name!r} has no input text to predict its answers with (prediction: "
                         "file-edit has)")
    return [e.metadata["original"] for e in examples]


def tests_pass(example: Example, completion: str, timeout_s: float = 10) -> float:
    """pass@1 reward: the code in the completion passes the example's tests within timeout_s seconds."""
    code = extract_code(completion, example.metadata.get("code_prompt"), example.entry_point)
    return code_reward(code, example.tests, example.entry_point, timeout_s=timeout_s)


def number_match(example: Example, completion: str) -> float:
    """accuracy reward: the completion's final number equals the reference's."""
    return math_reward(completion, example.reference)


def rouge2(example: Example, completion: str, max_words: int | None = None) -> float:
    """rouge2 reward: ROUGE-2 F1 against the reference, the completion cut to max_words words."""
    return rouge2_reward(completion, example.reference, max_words=max_words)


METRIC_REWARDS: dict[str, Callable[[Example, str], float]] = {
    "pass@1": tests_pass, "accuracy": number_match, "rouge2": rouge2}

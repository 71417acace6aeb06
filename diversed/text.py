"""Text around the token ids: prompts through the chat template, and stop strings."""

from __future__ import annotations

from collections.abc import Sequence

from diversed.decoding.engine import StopFn


def stop_checker(tokenizer, stop: Sequence[str]) -> StopFn | None:
    """A stop function for the decoding loop: true once the decoded new text holds a stop string."""
    return (lambda tokens: any(s in tokenizer.decode(tokens) for s in stop)) if stop else None


def cut_at_stop(text: str, stop: Sequence[str]) -> str:
    """The text before the first stop string."""
    for s in stop:
        text = text.split(s, 1)[0]
    return text


def encode_prompt(tokenizer, prompt: str, chat: bool | None = None, system: str | None = None) -> list[int]:
    """Token ids of a prompt, wrapped in the chat template as a user turn when chat is on (None: whenever
    the tokenizer has a template)."""
    if chat is None:
        chat = tokenizer.chat_template is not None
    if not chat:
        return tokenizer(prompt, add_special_tokens=True)["input_ids"]
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]

"""Text around the token ids: prompts through the chat template, and stop strings."""

from __future__ import annotations

from collections.abc import Sequence

from diversed.decoding.engine import StopFn


def stop_checker(tokenizer, stop: Sequence[str]) -> StopFn | None:
    """A stop function for the decoding loop: true once the decoded new text holds a stop string."""
    return (lambda tokens: any(s in tokenizer.decode(tokens) for s in stop)) if stop else None


def check_encodable(name: str, text: str) -> None:
    """ValueError naming the input if UTF-8 cannot encode it (a lone surrogate, which JSON and a shell's
    non-UTF-8 bytes can carry): a tokenizer would fail on it later, with a less helpful error."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(f"{name} holds {text[error.start:error.end]!r} at character {error.start}, which is not "
                         "text (a lone surrogate); it cannot be encoded") from None


def cut_at_stop(text: str, stop: Sequence[str]) -> str:
    """The text before the first stop string."""
    for s in stop:
        text = text.split(s, 1)[0]
    return text


def encode_prompt(tokenizer, prompt: str | list[dict], chat: bool | None = None, system: str | None = None
                  ) -> list[int]:
    """Token ids of a prompt, wrapped in the chat template as a user turn when chat is on (None: whenever
    the tokenizer has a template); a conversation (chat messages, role and content) goes through the template
    as it is."""
    if chat is None:
        chat = tokenizer.chat_template is not None
    if not chat:
        if isinstance(prompt, list):
            raise ValueError("a conversation (chat messages) needs the chat template")
        return tokenizer(prompt, add_special_tokens=True)["input_ids"]
    turns = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    return encode_messages(tokenizer, ([{"role": "system", "content": system}] if system else []) + turns)


def encode_messages(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of a conversation through the chat template, ready for the assistant's turn."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


class StreamedText:
    """The text of a growing list of new tokens, released in pieces that are never taken back: an unfinished
    UTF-8 character at the end is held back, and so is any end that may be the start of a stop string. The
    pieces joined equal cut_at_stop(tokenizer.decode(tokens)) of the final tokens."""

    def __init__(self, tokenizer, stop: Sequence[str]) -> None:
        self.tokenizer, self.stop, self.sent = tokenizer, tuple(stop), 0

    def update(self, tokens: Sequence[int], final: bool = False) -> str:
        """The text not yet released, for the tokens so far (all of it when `final`)."""
        text = cut_at_stop(self.tokenizer.decode(tokens, skip_special_tokens=True), self.stop)
        if not final:
            text = text.rstrip("\ufffd")  # the replacement character of a byte sequence still incomplete
            held = max((k for s in self.stop for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
            text = text[:len(text) - held]
        piece = text[self.sent:]
        self.sent = max(self.sent, len(text))
        return piece

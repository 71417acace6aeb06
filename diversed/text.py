"""Text around the token ids: prompts through the chat template, and stop strings."""

from __future__ import annotations

from collections.abc import Callable, Sequence


def stop_checker(tokenizer, stop: Sequence[str]) -> Callable[[list[int], int], int | None] | None:
    """A stop function for the decoding loop (StopFn): after a round appended tokens[start:], the number of
    tokens with which the text first holds a stop string, or None. It decodes the new tokens and, before
    them, enough to hold a stop string's beginning (a token is at least one byte), never the whole answer."""
    if not stop:
        return None
    context = 4 * max(map(len, stop))  # UTF-8 bytes of the longest stop string, at most: so many tokens

    def find(tokens: list[int], start: int) -> int | None:
        base = max(0, start - context)
        if not any(s in tokenizer.decode(tokens[base:]) for s in stop):
            return None
        return next(end for end in range(start + 1, len(tokens) + 1)
                    if any(s in tokenizer.decode(tokens[base:end]) for s in stop))

    return find


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
    pieces joined equal cut_at_stop(tokenizer.decode(tokens)) of the final tokens.

    A call decodes only the new tokens (new_text) and looks for stop strings in the new text only: a round's
    work does not grow with the answer."""

    def __init__(self, tokenizer, stop: Sequence[str]) -> None:
        self.tokenizer, self.stop = tokenizer, tuple(stop)
        self.longest = max(map(len, self.stop), default=0)
        self.tokens: list[int] = []
        self.decoded = 0  # tokens whose text is in self.text
        self.text = ""
        self.sent = 0  # characters released
        self.cut: int | None = None  # where the first stop string starts in self.text, once there is one

    def add(self, new: Sequence[int], final: bool = False) -> str:
        """The text not yet released, with `new` tokens appended (all of it when `final`)."""
        self.tokens += new
        if self.cut is None and len(self.tokens) > self.decoded:
            added = new_text(self.tokenizer, self.tokens, self.decoded, len(self.tokens), final)
            if added is not None:  # else a character is still incomplete: wait for it
                searched = max(0, len(self.text) - self.longest + 1)
                self.text += added
                self.decoded = len(self.tokens)
                self.cut = min((i for s in self.stop if (i := self.text.find(s, searched)) >= 0), default=None)
        end = len(self.text) if self.cut is None else self.cut
        if not final and self.cut is None:
            end -= max((k for s in self.stop for k in range(1, len(s)) if self.text.endswith(s[:k])), default=0)
        piece = self.text[self.sent:end]
        self.sent = max(self.sent, end)
        return piece


class TokenTexts:
    """The text each new token adds, token by token: a token that leaves a UTF-8 character unfinished adds ""
    and the one that finishes it the whole character. The texts joined equal the decoded tokens (special
    tokens skipped), but for a character still unfinished at the end."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.decoded = 0  # tokens whose text has been given

    def add(self, new: Sequence[int]) -> list[str]:
        """The text of each of `new`, appended to the tokens so far."""
        texts = []
        for token in new:
            self.tokens.append(token)
            added = new_text(self.tokenizer, self.tokens, self.decoded, len(self.tokens))
            texts.append(added or "")
            if added is not None:
                self.decoded = len(self.tokens)
        return texts


_CONTEXT = 4  # tokens decoded before new ones, so that a tokenizer that drops a leading space reads them in place


def new_text(tokenizer, tokens: list[int], start: int, end: int, final: bool = False) -> str | None:
    """The text tokens[start:end] add after tokens[:start], decoding only a few tokens before them (_CONTEXT):
    the work does not grow with the answer. None while a UTF-8 character is unfinished at `end` (unless final)."""
    base = max(0, start - _CONTEXT)
    before = tokenizer.decode(tokens[base:start], skip_special_tokens=True)
    after = tokenizer.decode(tokens[base:end], skip_special_tokens=True)
    if not final and after.endswith("\ufffd"):
        return None
    return after[len(before):]

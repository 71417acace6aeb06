"""What the decoding loop needs from a model, and nothing of any engine: the backend interface.

A backend is one file with two classes. Its Model is a frozen causal LM: vocabulary and hidden sizes,
context length, end-of-sequence tokens, and `rows(B, capacity)`, an empty batch of B sequences. Its Rows holds
that batch's KV cache: `feed` appends tokens to each row and returns the logits (and, when asked, the
last hidden states) at the last few of them; `truncate` keeps the first n tokens of each row and forgets
the rest (the rollback after a rejection); `select` keeps some rows (finished ones leave) and `extend`
adds empty ones (a request joins a running batch), which `reuse` may start from a prompt's prefix that a
row gone before held (a backend's prompt cache). Rows advance independently: every row sees exactly its own
tokens at positions 0, 1, 2, ... as if it ran alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
from torch import Tensor

from diversed.backends.prompt_cache import PromptCache


class Rows(Protocol):
    """The KV-cache state of a batch of sequences in one model."""

    @property
    def lengths(self) -> list[int]:
        """Tokens held per row."""

    def feed(self, tokens: Sequence[Sequence[int]], outputs: int, hidden: bool = False
             ) -> tuple[Tensor | None, Tensor]:
        """Append tokens[r] (at least `outputs` of them) to row r. Returns the last-layer hidden states
        (after the final norm: what feeds the LM head) [B, outputs, d] (always when `hidden`; a backend may
        return None otherwise, when they cost extra), and the float32 logits [B, outputs, V] at the last
        `outputs` tokens fed to each row."""

    def truncate(self, lengths: Sequence[int]) -> None:
        """Keep the first lengths[r] tokens of row r (at most what it holds) and drop the rest."""

    def select(self, rows: Sequence[int]) -> None:
        """Keep only the rows at these indices, in this order."""

    def extend(self, count: int) -> None:
        """Add `count` empty rows after the existing ones."""

    def reuse(self, row: int, prompt: Sequence[int]) -> int:
        """Give an empty row the longest prefix of `prompt` (less its last token) that the backend's prompt
        cache holds from rows gone before; how many tokens the row now holds (0: none, or no cache)."""


class Model(Protocol):
    """A frozen causal LM as the decoding loop sees it."""

    name: str
    backend: str  # the engine's name, one of diversed.backends.BACKENDS
    vocab_size: int  # the width of the logits; token ids are in [0, vocab_size)
    hidden_size: int  # the width of the last hidden state
    context_length: int | None  # positions a row may hold (None: no known limit)
    eos_token_ids: tuple[int, ...]  # tokens the model's own config says end a sequence
    device: torch.device  # where its logits and hidden states live
    # A pass over a multiple of this many tokens costs least per token (the engine's matrix kernels work in
    # tiles of it); a wider pass that is not a multiple costs more than the multiple below it. 1: no such step.
    pass_tile: int
    cache: PromptCache | None  # its prompt cache (diversed.backends.prompt_cache), None when off

    def rows(self, count: int, capacity: int | None = None) -> Rows:
        """An empty batch of `count` sequences, which `extend` may grow to `capacity` (default: count)."""

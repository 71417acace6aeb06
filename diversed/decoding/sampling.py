"""From logits to the distributions that drafting and verification use, and sampling from them."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from diversed.verify import draw


@dataclass(frozen=True)
class Sampling:
    """Temperature, top-k and top-p, applied to each model's logits separately, before any mixing.

    temperature 0 means greedy: the distributions stay untempered softmaxes and tokens are their argmax.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not 0 <= self.temperature < float("inf"):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def probs(self, logits: Tensor) -> Tensor:
        """float32 probabilities [..., V] from logits [..., V]."""
        logits = logits.float()
        if self.greedy:
            return torch.softmax(logits, dim=-1)
        logits = logits / self.temperature
        if self.top_k and self.top_k < logits.shape[-1]:
            kth = logits.topk(self.top_k, dim=-1).values[..., -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if self.top_p < 1.0:
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            sorted_probs = sorted_logits.softmax(-1)
            # Drop a token once the mass strictly before it already reaches top_p (the top token always stays).
            drop_sorted = sorted_probs.cumsum(-1) - sorted_probs >= self.top_p
            logits = logits.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))
        return torch.softmax(logits, dim=-1)

    def sample(self, probs: Tensor, generator: torch.Generator | None) -> Tensor:
        """One token per row of probs [B, V] -> [B]."""
        if self.greedy:
            return probs.argmax(-1)
        return draw(probs, generator)

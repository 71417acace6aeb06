"""How many tokens the draft proposes each round."""

from __future__ import annotations

from dataclasses import dataclass

SCHEDULES = ("constant", "heuristic")


@dataclass(frozen=True)
class DraftLength:
    """The draft length N and how it changes between rounds.

    constant: N every round. heuristic (transformers' schedule): +2 after a round in which the drafts were
    all kept, -1 (not below 1) otherwise; in a batch, a round counts as fully kept when at least half of the
    sequences kept all their drafts, since the batch shares one N.
    confidence: a sequence stops drafting in a round once its drafted token had draft probability below
    this (the token itself is still proposed); 0 disables it.
    """

    initial: int = 5
    schedule: str = "constant"
    maximum: int = 16
    confidence: float = 0.0

    def __post_init__(self) -> None:
        if not 1 <= self.initial <= self.maximum:
            raise ValueError(f"draft length must be in [1, {self.maximum}], got {self.initial}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"draft-length schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if not 0.0 <= self.confidence < 1.0:
            raise ValueError(f"draft confidence threshold must be in [0, 1), got {self.confidence}")

    @property
    def longest(self) -> int:
        """The longest round this schedule can draft."""
        return self.initial if self.schedule == "constant" else self.maximum

    def next(self, n: int, fully_kept_fraction: float) -> int:
        """The draft length of the next round, after a round of length n."""
        if self.schedule == "constant":
            return n
        return min(n + 2, self.maximum) if fully_kept_fraction >= 0.5 else max(n - 1, 1)

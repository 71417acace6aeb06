"""The draft model as a drafter: up to N tokens a round, one forward each, with their distributions q and, for a
DIVERSED head, the draft's hidden states. It keeps each row's text and the tokens its cache holds; what the
cache has not seen (a prompt, tokens written while it did not draft) is fed at the start of its next round."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from diversed.backends import Model
from diversed.backends.prompt_cache import common_prefix
from diversed.decoding.drafters.base import DrafterSetup, DraftRound, Proposal
from diversed.decoding.schedule import stopwatch


class ModelDrafter:
    """A draft model's rows. confidence: a row stops drafting in a round once its drafted token had draft
    probability below this (the token itself is still proposed); 0 disables it."""

    name = "model"
    has_hidden = True

    def __init__(self, model: Model, capacity: int, confidence: float = 0.0) -> None:
        self.draft_model, self.confidence = model, confidence
        self.rows = model.rows(0, capacity)
        self.texts: list[list[int]] = []
        self.fed: list[list[int]] | None = None  # this round's drafts that the cache saw, per row

    @classmethod
    def build(cls, setup: DrafterSetup) -> ModelDrafter | None:
        return None if setup.draft is None else cls(setup.draft, setup.capacity, setup.confidence)

    def add(self, prompt: Sequence[int], prediction: Sequence[int] | None = None, cache_prompt: bool = True
            ) -> None:
        self.rows.extend(1)
        if cache_prompt:  # what the draft's prompt cache holds is not fed again
            self.rows.reuse(len(self.texts), prompt)
        self.texts.append(list(prompt))

    def select(self, rows: Sequence[int]) -> None:
        self.rows.select(rows)
        self.texts = [self.texts[r] for r in rows]

    @property
    def unseen(self) -> int:
        """Tokens of all rows together that the draft model's cache has not seen: a catch-up's whole work."""
        return sum(len(t) - n for t, n in zip(self.texts, self.rows.lengths, strict=True))

    @property
    def behind(self) -> int:
        """The most tokens a row's cache has not seen: over 2, a round's forwards are not draft steps alone."""
        return max((len(t) - n for t, n in zip(self.texts, self.rows.lengths, strict=True)), default=0)

    def propose(self, ask: DraftRound) -> Proposal | None:
        caps, behind = ask.caps, self.behind
        if max(caps, default=0) == 0:
            return None
        pending = [t[n:] for t, n in zip(self.texts, self.rows.lengths, strict=True)]
        drafts, q, hidden, lengths, seconds = self._draft(pending, list(caps), ask)
        self.fed = [row[:-1] for row in drafts.tolist()]  # the last draft is never fed
        catch_up = behind > 2
        steps = seconds[1:] if catch_up else seconds  # a first step that caught up is no draft step's cost
        return Proposal(drafts, lengths, q, hidden, drafts.shape[1],
                        [self.name if n else None for n in lengths.tolist()], sum(steps), len(steps),
                        (behind, seconds[0]) if catch_up else None)

    def advance(self, emitted: Sequence[Sequence[int]]) -> None:
        if self.fed is not None:  # keep what the cache saw that the row then wrote, less its last token, which
            # the next round feeds to draft from
            self.rows.truncate([len(t) + min(common_prefix(f, e), len(e) - 1)
                                for t, f, e in zip(self.texts, self.fed, emitted, strict=True)])
            self.fed = None
        for text, written in zip(self.texts, emitted, strict=True):
            text.extend(written)

    def _draft(self, tokens: list[list[int]], caps: list[int], ask: DraftRound
               ) -> tuple[Tensor, Tensor, Tensor | None, Tensor, list[float]]:
        """Propose up to caps[r] tokens for row r after feeding it `tokens`. Returns drafts [B, n'], their
        distributions q [B, n', V], the draft's hidden states that produced q [B, n', d] (when asked for),
        each row's draft length [B] (its cap, or less where the confidence cut-off stopped it; n' is the
        longest), and each step's seconds (forward and sampling: what a draft step costs)."""
        drafts, probs, states, seconds = [], [], [], []
        lengths = torch.tensor(caps)
        for i in range(max(max(caps), 1)):
            lap = stopwatch(self.draft_model.device, synchronize=ask.timed)
            h, logits = self.rows.feed(tokens, 1, hidden=ask.hidden)
            x, q = ask.sample(logits[:, -1])
            seconds.append(lap())
            drafts.append(x)
            probs.append(q)
            if ask.hidden:
                states.append(h[:, -1])
            if self.confidence:
                unsure = (q.gather(-1, x.unsqueeze(-1)).squeeze(-1) < self.confidence).cpu()
                lengths = torch.where(unsure & (lengths > i + 1), i + 1, lengths)
            if (lengths <= i + 1).all():
                break
            tokens = [[t] for t in x.tolist()]
        return (torch.stack(drafts, 1), torch.stack(probs, 1), torch.stack(states, 1) if ask.hidden else None,
                lengths.clamp(max=len(drafts)), seconds)

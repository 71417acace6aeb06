"""The default drafter, all the others together: each round, the best of the copying drafters (the request's
prediction, prompt lookup and the suffix cache, for each row), the draft model, or no drafts (the target alone).
Under the speed schedule the speed model chooses, by the tokens per second it predicts for each from measured
costs and each drafter's running acceptance (diversed.decoding.scheduler)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import Tensor

from diversed.decoding.drafters.base import (
    Candidate,
    CopyDrafter,
    Drafter,
    DraftRound,
    Proposal,
    best_candidate,
    copied,
)
from diversed.decoding.drafters.model import ModelDrafter


class AutoDrafter:
    """Every drafter that can run: the copying ones and, where the pair has one, the draft model. Each row
    drafts by itself: from its prediction where it has one, else by the draft model where there is one, else
    by copying. Under the speed schedule the Scheduler chooses for the batch instead (one pass, one width), from
    best_copies and the draft model. A mixture head (which reads the draft model's hidden states) gets the draft
    model's drafts only."""

    name = "auto"

    def __init__(self, members: Sequence[Drafter]) -> None:
        self.members = list(members)
        self.copiers = [m for m in self.members if isinstance(m, CopyDrafter)]
        self.model: ModelDrafter | None = next((m for m in self.members if isinstance(m, ModelDrafter)), None)
        self.has_hidden = self.model is not None
        self.draft_model = None if self.model is None else self.model.draft_model

    def add(self, prompt: Sequence[int], prediction: Sequence[int] | None = None, cache_prompt: bool = True
            ) -> None:
        for member in self.members:
            member.add(prompt, prediction, cache_prompt)

    def select(self, rows: Sequence[int]) -> None:
        for member in self.members:
            member.select(rows)

    def advance(self, emitted: Sequence[Sequence[int]]) -> None:
        for member in self.members:
            member.advance(emitted)

    def best_copies(self, ask: DraftRound) -> tuple[list[Candidate | None], list[str]]:
        """Each row's copy from the copying drafter expected to add the most tokens within the row's cap (ties:
        the first, the prediction), and that drafter's name."""
        per_copier = [copier.candidates(ask.only(copier.name).caps) for copier in self.copiers]
        rows = list(zip(*per_copier, strict=True))
        chosen = [best_candidate(options, cap) for options, cap in zip(rows, ask.caps, strict=True)]
        return [options[i] for options, i in zip(rows, chosen, strict=True)], [self.copiers[i].name for i in chosen]

    def propose(self, ask: DraftRound) -> Proposal | None:
        model_ask = ask.only("model")
        if ask.hidden:  # a mixture head reads the draft model's hidden states: its drafts only
            return self.model.propose(model_ask) if self.model is not None else None
        best, names = self.best_copies(ask)
        # Row by row, so that a row's drafts never depend on its company: its prediction where it has one, else
        # the draft model where it may use one, else its best copy.
        by_model = [cap > 0 and not (c is not None and name == "prediction")
                    for cap, c, name in zip(model_ask.caps, best, names, strict=True)]
        drafted = None
        if self.model is not None and any(by_model):
            caps = [cap if m else 0 for cap, m in zip(model_ask.caps, by_model, strict=True)]
            drafted = self.model.propose(replace(model_ask, caps=caps))
        copies = copied([None if m else c for c, m in zip(best, by_model, strict=True)], names)
        return _beside(drafted, copies)


def _beside(drafted: Proposal | None, copies: Proposal | None) -> Proposal | None:
    """The draft model's proposal and copied drafts for the other rows as one proposal: a copied token's q is
    its point mass (so each rule decides it as it would alone, docs/algorithm.md section 6.1), and the round
    costs the draft model's forwards."""
    if drafted is None or copies is None:
        return drafted or copies
    width = max(drafted.tokens.shape[1], copies.tokens.shape[1])
    device = drafted.tokens.device
    mine = (copies.lengths > 0).unsqueeze(-1).to(device)
    tokens = torch.where(mine, _widen(copies.tokens.to(device), width), _widen(drafted.tokens, width))
    vocab = drafted.q.shape[-1]
    q_drafted = torch.cat([drafted.q, F.one_hot(tokens[:, drafted.q.shape[1]:], vocab).to(drafted.q)], 1)
    q = torch.where(mine.unsqueeze(-1), F.one_hot(tokens, vocab).to(drafted.q), q_drafted)
    sources = [c or d for c, d in zip(copies.sources, drafted.sources, strict=True)]
    return replace(drafted, tokens=tokens, lengths=torch.maximum(drafted.lengths, copies.lengths), q=q,
                   hidden=None, sources=sources)


def _widen(tokens: Tensor, width: int) -> Tensor:
    """Drafts [B, n] padded to [B, width] by repeating each row's last (padding is never verified)."""
    return torch.cat([tokens, tokens[:, -1:].expand(-1, width - tokens.shape[1])], 1)

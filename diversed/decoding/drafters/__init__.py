"""Drafters: what proposes the tokens a round verifies (base.py has the interface). `model` is the draft model;
`lookup` and `suffix` copy from text already there and `prediction` from the request's predicted output, at no
forward's cost; `auto` chooses among them each round."""

from __future__ import annotations

from diversed.backends import Model
from diversed.decoding.drafters.auto import AutoDrafter
from diversed.decoding.drafters.base import Drafter, DraftRound, Proposal
from diversed.decoding.drafters.lookup import LookupDrafter
from diversed.decoding.drafters.model import ModelDrafter
from diversed.decoding.drafters.prediction import PredictionDrafter, prediction_tokens
from diversed.decoding.drafters.suffix import SuffixCache, SuffixDrafter
from diversed.request import DRAFTERS


def make_drafter(name: str, draft: Model | None = None, *, capacity: int = 1, confidence: float = 0.0,
                 cache: SuffixCache | None = None) -> Drafter:
    """The drafter called `name` for a batch of up to `capacity` rows. draft: the draft model (needed by
    "model"; "auto" uses it where given); confidence: the draft model's cut-off (DraftLength.confidence);
    cache: the suffix cache to share (a server's, across requests; default: a new one)."""
    if name not in DRAFTERS:
        raise ValueError(f"drafter must be one of {DRAFTERS}, got {name!r}")
    if name == "model":
        if draft is None:
            raise ValueError("drafter 'model' needs a draft model")
        return ModelDrafter(draft, capacity, confidence)
    if name == "lookup":
        return LookupDrafter()
    if name == "prediction":
        return PredictionDrafter()
    suffix = SuffixDrafter(cache if cache is not None else SuffixCache())
    if name == "suffix":
        return suffix
    return AutoDrafter([PredictionDrafter(), LookupDrafter(), suffix],
                       None if draft is None else ModelDrafter(draft, capacity, confidence))


__all__ = ["DRAFTERS", "AutoDrafter", "DraftRound", "Drafter", "LookupDrafter", "ModelDrafter", "PredictionDrafter",
           "Proposal", "SuffixCache", "SuffixDrafter", "make_drafter", "prediction_tokens"]

"""Drafters: what proposes the tokens a round verifies (base.py has the interface), one file each, listed in
diversed.request.DRAFTER_CLASSES. `model` is the draft model; `lookup` and `suffix` copy from text already there
and `prediction` from the request's predicted output, at no forward's cost; `auto` is all of them together."""

from __future__ import annotations

import importlib

from diversed.backends import Model
from diversed.decoding.drafters.auto import AutoDrafter
from diversed.decoding.drafters.base import CopyDrafter, Drafter, DrafterSetup, DraftRound, Proposal
from diversed.decoding.drafters.model import ModelDrafter
from diversed.decoding.drafters.prediction import prediction_tokens
from diversed.decoding.drafters.suffix import SuffixCache
from diversed.request import DRAFTER_CLASSES


def make_drafter(name: str, draft: Model | None = None, *, capacity: int = 1, confidence: float = 0.0,
                 cache: SuffixCache | None = None) -> Drafter | None:
    """The drafter called `name` (diversed.request.DRAFTERS, checked there) for a batch of up to `capacity`
    rows; None where it cannot run ("model" without a draft model). draft: the draft model; confidence: its
    cut-off (Drafting.confidence); cache: the suffix cache to share (a server's, across requests; default:
    a new one)."""
    setup = DrafterSetup(draft, capacity, confidence, SuffixCache() if cache is None else cache)
    if name != "auto":
        return _drafter_class(name).build(setup)
    return AutoDrafter([m for m in (_drafter_class(n).build(setup) for n in DRAFTER_CLASSES) if m is not None])


def _drafter_class(name: str) -> type:
    module, _, kind = DRAFTER_CLASSES[name].partition(".")
    return getattr(importlib.import_module(f"{__name__}.{module}"), kind)


__all__ = ["AutoDrafter", "CopyDrafter", "DraftRound", "Drafter", "DrafterSetup", "ModelDrafter", "Proposal",
           "SuffixCache", "make_drafter", "prediction_tokens"]

"""Who drafts each round, and how many tokens: the draft length's schedule, and under the "speed" schedule the
speed model's choice between the drafters, their widths and the target alone (docs/algorithm.md section 6).

The drafters only propose and advance; the Scheduler asks them, cuts what they propose to the width it predicts
fastest, and learns the costs from the rounds the batch times. It owns the batch's speed model, one per batch
size, starting from (and handing back to) a CostMemory that whoever made it loads and saves.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from diversed.decoding.drafters import AutoDrafter, CopyDrafter, Drafter, DraftRound, ModelDrafter, Proposal
from diversed.decoding.drafters.base import Candidate, copied
from diversed.decoding.schedule import CostMemory, SpeedModel
from diversed.request import Drafting

# The most tokens (all rows together) a draft model not timed yet may catch up on to get timed: on a CPU the
# catch-up over conversations' histories stalls every row for longer than short answers gain (a minute at four
# 2,000-token conversations: benchmarks/results/chat-speed.md).
UNTIMED_CATCH_UP = 512


class Scheduler:
    """The draft length of each round (`n`, by the constant or heuristic schedule), or under the speed schedule
    the speed model's choice. costs: where the speed model's measured costs come from and go back to (None: a
    memory of this scheduler's own)."""

    def __init__(self, drafting: Drafting, costs: CostMemory | None = None) -> None:
        self.drafting = drafting
        self.costs = CostMemory() if costs is None else costs
        self.n = drafting.initial
        self.speed: SpeedModel | None = None
        self._key: tuple | None = None

    @property
    def measured(self) -> bool:
        """Whether rounds are timed for a speed model (then a GPU's queue is drained around them)."""
        return self.drafting.schedule == "speed"

    @property
    def longest(self) -> int:
        """The most drafts the next round may have."""
        return self.drafting.maximum if self.measured else self.n

    def begin(self, key: tuple, tile: int, joined: bool) -> None:
        """Before a round: the speed model for the batch's models and size (key). Costs are per (models, rows),
        so when jobs join and the size changes, the costs known for the new size take over (the acceptance
        stays)."""
        if not self.measured or (self.speed is not None and not (joined and key != self._key)):
            return
        fresh = self.costs.speed_model(key, self.drafting.maximum, tile)
        if self.speed is not None:
            self.costs.keep(self._key, self.speed)
            fresh.kept, fresh.rejections = self.speed.kept, self.speed.rejections
        else:  # a step of the target alone is never remembered: nothing is chosen before one is timed
            fresh.draft_length = self.drafting.initial
        self.speed, self._key = fresh, key

    def propose(self, drafter: Drafter, ask: DraftRound) -> Proposal | None:
        """This round's drafts (None: the target alone): the drafter's up to the caps, or the speed model's
        fastest choice."""
        if self.speed is None:
            return drafter.propose(ask)
        if isinstance(drafter, ModelDrafter):
            return self._model_round(drafter, ask)
        if isinstance(drafter, CopyDrafter):
            candidates = drafter.candidates(ask.caps)
            return copied(candidates, [drafter.name] * len(candidates), copy_width(candidates, self.speed)[0])
        return self._any_round(drafter, ask)

    def observe_step(self, seconds: float, prefill: bool) -> None:
        """A step of the target alone took `seconds` (a round that fed prompts is not a step's cost)."""
        if self.speed is not None and not prefill:
            self.speed.observe_plain(seconds)
            self.speed.draft_length = self.speed.best_length()

    def observe_round(self, proposal: Proposal, kept: Sequence[int], drafted: Sequence[int], seconds: float,
                      prefill: bool) -> None:
        """A speculative round: each row kept `kept[r]` of its `drafted[r]` drafts, and the target's pass over
        them (with sampling and verification) took `seconds`."""
        if self.speed is None:
            # Only rows that drafted give a verdict (a row of the target alone drafts nothing); from the length
            # asked for, since a cut-off is no verdict either.
            verdicts = [k == d for k, d in zip(kept, drafted, strict=True) if d > 0]
            if verdicts:
                self.n = self.drafting.next(self.n, sum(verdicts) / len(verdicts))
            return
        if prefill:  # a round that fed prompts is not a round's cost
            return
        width = proposal.tokens.shape[1] + 1
        if proposal.forwards:  # the draft model's round
            self.speed.observe(list(kept), list(drafted), proposal.draft_steps,
                               proposal.draft_seconds if proposal.draft_steps else None, width, seconds)
        else:
            self.speed.observe_copied(width, seconds)
        self.speed.draft_length = self.speed.best_length()

    def close(self) -> None:
        """Hand the measured costs to `costs`, for later batches of the same models."""
        if self.speed is not None:
            self.costs.keep(self._key, self.speed)

    def _model_round(self, model: ModelDrafter, ask: DraftRound) -> Proposal | None:
        """The draft model's round at the speed model's length, unless catching up on what the target wrote
        alone would cost more than the drafts gain."""
        speed, behind = self.speed, model.behind
        catch_up = behind > 2
        # A round that catches up times no draft step with its first forward: with none timed yet, it drafts two,
        # so that the second is.
        length = max(speed.draft_length, 2) if catch_up and not speed.draft_steps else speed.draft_length
        if length and catch_up and speed.draft_steps and speed.model_rate(length, behind) < speed.tokens_per_second(0):
            return None
        proposal = model.propose(replace(ask, caps=[min(c, length) for c in ask.caps]))
        if proposal is not None and proposal.catch_up is not None:
            speed.observe_catch_up(*proposal.catch_up)
        return proposal

    def _any_round(self, drafter: AutoDrafter, ask: DraftRound) -> Proposal | None:
        """The "auto" drafter's round: the best copy of each row, the draft model, or none, whichever the speed
        model predicts fastest. A mixture head (which reads the draft model's hidden states) gets the draft
        model's drafts only."""
        speed, model, model_ask = self.speed, drafter.model, ask.only("model")
        if ask.hidden:
            return self._model_round(model, model_ask) if model is not None else None
        best, names = drafter.best_copies(ask)
        if 1 not in speed.width:  # a step of the target alone first: every choice is weighed against it
            return None
        width, copy_rate = copy_width(best, speed)
        n_model = speed.draft_length if model is not None and any(model_ask.caps) else 0
        if n_model:
            # A draft model not timed yet drafts when copying has nothing to offer and its catch-up is short, so
            # that it gets timed. Once timed, it drafts where it is predicted fastest, paying for the tokens it
            # has to catch up on (those written while copying or the target alone wrote them).
            untimed = not speed.draft_steps
            if (not width and model.unseen <= UNTIMED_CATCH_UP) if untimed else \
                    speed.model_rate(n_model, model.behind) >= max(copy_rate, speed.tokens_per_second(0)):
                return self._model_round(model, model_ask)
        return copied(best, names, width)


def copy_width(candidates: Sequence[Candidate | None], speed: SpeedModel) -> tuple[int, float]:
    """The width n (0: the target alone; else one of speed.draft_lengths) and its predicted tokens per second
    and row, for drafts that cost nothing: mean over rows of the tokens a round writes, over the verify pass's
    time at width n + 1. Until a step of the target alone is timed, 0 (so that one is)."""
    if 1 not in speed.width:
        return 0, 0.0
    longest = max((len(c.tokens) for c in candidates if c is not None), default=0)
    best, best_rate = 0, speed.tokens_per_second(0)
    for n in speed.draft_lengths(longest):
        tokens = sum(1.0 if c is None else c.expected_tokens(n) for c in candidates) / len(candidates)
        if (rate := tokens / speed.verify_time(n + 1)) > best_rate:
            best, best_rate = n, rate
    return best, best_rate

"""What the decoding loop needs from a drafter, and what every drafter shares.

A drafter sees rows of token ids and nothing of the loop's machinery: rows join with their prompt (`add`) and
leave (`select`), as in the backends' Rows; each round it is asked for drafts (`propose`, with a DraftRound:
each row's cap, and for the draft model how rows sample and whether hidden states are wanted) and returns
them with their draft distribution q, or none (a point mass on each drafted token: a drafter that copies text
has no distribution); afterwards it is told what each row wrote (`advance`: its kept drafts and the next
token, or the token of a step of the target alone), from which it counts what it got kept. The draft model is
one drafter among others.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol

import torch
from torch import Tensor

from diversed.backends.prompt_cache import common_prefix
from diversed.decoding.schedule import geometric_tau

if TYPE_CHECKING:
    from diversed.backends import Model


@dataclass(frozen=True)
class DraftRound:
    """What the loop asks of a drafter in one round. caps[r]: at most this many drafts for row r (0: none);
    allowed[r]: which drafter may draft for row r ("auto": any member of an auto drafter); sample: a draft
    model's logits [B, V] to each row's drafted token [B] and its distribution q [B, V], by the row's own
    sampling and random stream; hidden: the draft model's hidden states are wanted (a mixture head reads
    them); timed: the round is timed for the speed model (a GPU's queue is drained around each draft step)."""

    caps: list[int]
    allowed: list[str]
    sample: Callable[[Tensor], tuple[Tensor, Tensor]]
    hidden: bool = False
    timed: bool = False

    def only(self, drafter: str) -> DraftRound:
        """This round with cap 0 for the rows that `drafter` may not draft for."""
        return replace(self, caps=[cap if allowed in ("auto", drafter) else 0
                                   for cap, allowed in zip(self.caps, self.allowed, strict=True)])


@dataclass
class Proposal:
    """One round's drafts: tokens [B, n] (row r drafted lengths[r] of them; the rest is padding), q [B, n, V]
    or None for point masses, the draft model's hidden states [B, n, d] where a head needs them, the draft
    forwards run, which drafter wrote each row's drafts (None: the row drafted nothing), the seconds and
    number of the forwards that were draft steps alone, and a first forward that caught up on tokens the
    draft model had not seen (for the speed model)."""

    tokens: Tensor
    lengths: Tensor
    q: Tensor | None
    hidden: Tensor | None
    forwards: int
    sources: list[str | None]
    draft_seconds: float = 0.0
    draft_steps: int = 0
    catch_up: tuple[int, float] | None = None  # tokens per row the draft model caught up on first, and the seconds


@dataclass(frozen=True)
class DrafterSetup:
    """What a drafter may be built from (`build`): the draft model (None: the pair has none), the most rows at
    once, the draft model's confidence cut-off (Drafting.confidence) and the suffix cache shared by a
    process's requests."""

    draft: Model | None
    capacity: int = 1
    confidence: float = 0.0
    cache: object = None  # diversed.decoding.drafters.suffix.SuffixCache


class Drafter(Protocol):
    """Proposes drafts for the rows of a batch; one file per drafter in this package, listed once in
    diversed.request.DRAFTER_CLASSES."""

    name: str
    has_hidden: bool  # whether its proposals carry the draft model's hidden states (what a DIVERSED head reads)
    draft_model: Model | None  # the draft model it runs, if any

    @classmethod
    def build(cls, setup: DrafterSetup) -> Drafter | None:
        """This drafter for a batch, or None where it cannot run (the draft model's, without one)."""

    def add(self, prompt: Sequence[int], prediction: Sequence[int] | None = None, cache_prompt: bool = True
            ) -> None:
        """A row joins, after the existing ones, with its prompt and what its answer is predicted to be, if
        anything (Predicted Outputs: only the prediction drafter reads it); cache_prompt: a draft model may start
        from what its prompt cache holds (the request's own cache_prompt)."""

    def select(self, rows: Sequence[int]) -> None:
        """Keep only these rows, in this order."""

    def propose(self, ask: DraftRound) -> Proposal | None:
        """Up to ask.caps[r] drafts for row r; None where it has nothing to propose."""

    def advance(self, emitted: Sequence[Sequence[int]]) -> None:
        """What each row wrote this round, in order (its kept drafts, then the next token)."""


# A kind of proposal starts as if 1 of 6 had been kept: it drafts once it has shown better (it learns from
# rounds it did not draft too). Chosen by replay on training prompts (benchmarks/copy_replay.py).
PRIOR = (1.0, 5.0)
# A copy that has gone on for LONG_RUN tokens is its own kind of proposal, by how long (16-63, 64 and more),
# whatever started it: a file sent back with one change is copied for hundreds of tokens. Such a kind starts
# from RUN_PRIOR, chosen by replay on training prompts (benchmarks/copy_replay.py --long; the rule and the runs:
# benchmarks/results/whole-file-edits.md).
LONG_RUN = 16
RUN_PRIOR = (64.0, 1.0)


class Acceptance:
    """The running acceptance of point-mass drafts, per kind of proposal (a drafter's `bucket`: how long a
    match it copies from, how the last proposal did): decayed counts of kept drafts and rejections, the
    maximum-likelihood estimate for geometric runs, each kind starting from `prior` pseudo-counts (kept,
    rejected), the kinds of long runs (("run", ...)) from `run_prior`.

    It learns from every round, drafted or not: a proposal is compared with what the row then wrote. Where the
    proposal was verified, that is what the rule kept; where the target decided alone, a token drawn from p
    equals a proposed x with probability p(x), exact verification's acceptance of a point mass, so the
    estimate stays unbiased for exact (and conservative for relaxed rules) without drafting to learn."""

    def __init__(self, prior: tuple[float, float] = PRIOR, run_prior: tuple[float, float] = RUN_PRIOR,
                 decay: float = 0.95) -> None:
        self.counts: dict[tuple, list[float]] = {}
        self.prior, self.run_prior, self.decay = prior, run_prior, decay

    def _prior(self, bucket: tuple) -> tuple[float, float]:
        return self.run_prior if bucket[0] == "run" else self.prior

    def rate(self, bucket: tuple) -> float:
        kept, rejected = self.counts.get(bucket, self._prior(bucket))
        return kept / (kept + rejected)

    def observe(self, bucket: tuple, proposed: Sequence[int], written: Sequence[int]) -> int:
        """Score a proposal against what the row wrote; returns how many of its tokens matched."""
        matched = common_prefix(proposed, written)
        counts = self.counts.setdefault(bucket, list(self._prior(bucket)))
        counts[0] = self.decay * counts[0] + matched
        # A mismatch inside what was written is a rejection; a proposal longer than it tells nothing more.
        counts[1] = self.decay * counts[1] + (matched < min(len(proposed), len(written)))
        return matched


@dataclass
class Candidate:
    """A copying drafter's proposal for one row: tokens, the kind of proposal, its predicted acceptance."""

    tokens: list[int]
    bucket: tuple
    acceptance: float

    def expected_tokens(self, n: int) -> float:
        """Tokens a round writes if the first n of these are drafted (geometric acceptance)."""
        return geometric_tau(self.acceptance, min(n, len(self.tokens)))


LONGEST_MATCH = 8  # the longest n-gram a copying drafter looks up; a longer match is rarer and adds little


def match_class(n: int) -> int:
    """Match lengths (or runs of agreement) by what they predict of acceptance: 0-3 each, 4-5, 6-15, 16-63,
    64 and more."""
    return next((low for low in (64, 16, 6, 4) if n >= low), n)


def outcome(last: Candidate | None, written: Sequence[int]) -> str:
    """How a row's previous proposal fared against what it wrote: "run" (all of what could be compared
    matched: a copy is under way), "miss", or "none" (nothing proposed)."""
    if last is None or not written:
        return "none"
    compared = min(len(last.tokens), len(written))
    return "run" if list(last.tokens[:compared]) == list(written[:compared]) else "miss"


class CopyDrafter:
    """A drafter that copies from text it has seen (its `candidate` says what): no model, no forward, a point
    mass on each drafted token. It keeps each row's text (prompt and everything written since) and learns,
    per kind of proposal, how often its proposals are kept (Acceptance), which the speed schedule weighs
    (diversed.decoding.scheduler): a zero-cost draft pays wherever the tokens it is expected to add outweigh
    the wider pass."""

    name = "copy"
    has_hidden = False
    draft_model = None

    def __init__(self) -> None:
        self.texts: list[list[int]] = []
        self.last: list[Candidate | None] = []  # each row's latest candidate, scored by `advance`
        self.runs: list[int] = []  # per row, how many tokens in a row its proposals have foretold
        self.outcomes: list[str] = []  # per row, how its previous proposal fared (outcome)
        self.acceptance = Acceptance()

    @classmethod
    def build(cls, setup: DrafterSetup) -> CopyDrafter:
        return cls()

    def candidate(self, row: int, cap: int) -> Candidate | None:
        """What this drafter would propose for row `row`, at most cap tokens (None: nothing to copy)."""
        raise NotImplementedError

    def bucket(self, row: int, short: tuple) -> tuple:
        return run_bucket(self.runs[row], short)

    def add(self, prompt: Sequence[int], prediction: Sequence[int] | None = None, cache_prompt: bool = True
            ) -> None:
        self.last.append(None)
        self.runs.append(0)
        self.outcomes.append("none")
        self.texts.append(self._open(prompt, prediction))

    def _open(self, prompt: Sequence[int], prediction: Sequence[int] | None) -> list[int]:
        """A joining row's own state; returns its text as this drafter keeps it (the prompt, here)."""
        return list(prompt)

    def select(self, rows: Sequence[int]) -> None:
        self.texts = [self.texts[r] for r in rows]
        self.last = [self.last[r] for r in rows]
        self.runs = [self.runs[r] for r in rows]
        self.outcomes = [self.outcomes[r] for r in rows]

    def candidates(self, caps: Sequence[int]) -> list[Candidate | None]:
        """Every row's candidate (kept, to be scored against what the row writes)."""
        self.last = [self.candidate(row, cap) if cap > 0 else None for row, cap in enumerate(caps)]
        return self.last

    def propose(self, ask: DraftRound) -> Proposal | None:
        candidates = self.candidates(ask.caps)
        return copied(candidates, [self.name] * len(candidates))

    def advance(self, emitted: Sequence[Sequence[int]]) -> None:
        self.outcomes = [outcome(last, written) for last, written in zip(self.last, emitted, strict=True)]
        for row, (written, last) in enumerate(zip(emitted, self.last, strict=True)):
            matched = 0 if last is None else self.acceptance.observe(last.bucket, last.tokens, written)
            # A run goes on while every proposal matched all of what could be compared with it.
            whole = last is not None and matched == min(len(last.tokens), len(written))
            self.runs[row] = self.runs[row] + matched if whole else 0
            self._append(row, written)
        self.last = [None] * len(self.texts)

    def _append(self, row: int, tokens: Sequence[int]) -> None:
        self.texts[row].extend(tokens)


def run_bucket(run: int, short: tuple) -> tuple:
    """A proposal's kind: ("run", 16 or 64) after a run of that many foretold tokens, else `short`."""
    return ("run", 64 if run >= 64 else LONG_RUN) if run >= LONG_RUN else short


def best_candidate(options: Sequence[Candidate | None], cap: int) -> int:
    """Which of one row's candidates (one per copying drafter) is expected to add the most tokens within cap."""
    return max(range(len(options)), key=lambda i: -1.0 if options[i] is None else options[i].expected_tokens(cap))


def copied(candidates: Sequence[Candidate | None], names: Sequence[str], width: int | None = None
           ) -> Proposal | None:
    """A proposal of point masses from each row's candidate, cut to `width` (None: all of each candidate);
    None where it drafts nothing."""
    if width is None:
        width = max((len(c.tokens) for c in candidates if c is not None), default=0)
    if width == 0:
        return None
    lengths = [0 if c is None else min(len(c.tokens), width) for c in candidates]
    padded = [(c.tokens[:width] if c is not None else []) for c in candidates]
    tokens = torch.tensor([t + [t[-1] if t else 0] * (width - len(t)) for t in padded])
    return Proposal(tokens, torch.tensor(lengths), None, None, 0,
                    [name if n else None for name, n in zip(names, lengths, strict=True)])

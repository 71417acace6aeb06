"""Predicted Outputs (OpenAI's `prediction`): a request says what it expects most of its answer to be (a file
returned with one function changed), and this drafter proposes the prediction's continuation from where the
answer stands in it. It keeps that place token by token; where the answer departs from the prediction
(inserts, deletes or changes something) it finds its place again from the answer's latest tokens, at their
first occurrence in the prediction after where it was last aligned (an edit moves forward through a file),
and it proposes nothing while no recent n-gram of the answer occurs in the prediction."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from difflib import SequenceMatcher

from diversed.decoding.drafters.base import LONGEST_MATCH, Acceptance, Candidate, CopyDrafter, match_class, run_bucket

# A prediction is the user's word that the answer repeats it: a proposal from one starts as if 1 of 2 had been
# kept (copying drafters start at 1 of 6), a long run of it from RUN_PRIOR. Both chosen by replay on the
# workload that has predictions, jointly and alternating with the copying drafters' base.RUN_PRIOR
# (benchmarks/copy_replay.py --long): more optimism broke more drafts where the answer departs from the file.
PRIOR = (1.0, 1.0)
RUN_PRIOR = (64.0, 1.0)
SURE_RUN = 4  # tokens of agreement after which a place is sure enough to look forward from


class Prediction:
    """One row's prediction (token ids), where the answer stands in it (`place`: the index of the token
    expected next; None: lost), and how many of the answer's latest tokens agree with it there (`run`)."""

    def __init__(self, tokens: Sequence[int]) -> None:
        self.tokens = list(tokens)
        self.places: dict[tuple[int, ...], list[int]] = {}  # n-gram -> positions of the token after it, ascending
        for i in range(1, len(self.tokens) + 1):
            for n in range(1, min(LONGEST_MATCH, i) + 1):
                self.places.setdefault(tuple(self.tokens[i - n:i]), []).append(i)
        self.place: int | None = 0  # an answer is expected to begin where its prediction does
        self.anchor = 0  # the place when last surely aligned: where a lost row looks first, forward
        self.run = 0
        self.recent: list[int] = []  # the answer's latest LONGEST_MATCH tokens

    def follow(self, written: Sequence[int]) -> None:
        """Move along the prediction with each token the answer wrote."""
        for token in written:
            self.recent = [*self.recent[1 - LONGEST_MATCH:], token]
            if self.place is not None and self.place < len(self.tokens) and self.tokens[self.place] == token:
                self.place += 1
                self.run += 1
            else:
                self._find_place()
            if self.run >= SURE_RUN:
                self.anchor = self.place

    def _find_place(self) -> None:
        """The longest n-gram ending the answer that occurs in the prediction, at its first occurrence at or
        after the anchor (else its last one before it); lost if none."""
        for n in range(len(self.recent), 0, -1):
            places = self.places.get(tuple(self.recent[-n:]))
            if places:
                i = bisect_left(places, self.anchor)
                self.place, self.run = places[i] if i < len(places) else places[-1], n
                return
        self.place, self.run = None, 0


class PredictionDrafter(CopyDrafter):
    """Each row's prediction (rows without one propose nothing); its proposals start from `prior`, its long
    runs from `run_prior` (Acceptance)."""

    name = "prediction"

    def __init__(self, prior: tuple[float, float] = PRIOR, run_prior: tuple[float, float] = RUN_PRIOR) -> None:
        self.predictions: list[Prediction | None] = []
        super().__init__()
        self.acceptance = Acceptance(prior, run_prior)

    def _open(self, prompt: Sequence[int], prediction: Sequence[int] | None) -> list[int]:
        self.predictions.append(Prediction(prediction) if prediction else None)
        return []  # the row's text is its prediction's business: nothing else is copied from

    def select(self, rows: Sequence[int]) -> None:
        self.predictions = [self.predictions[r] for r in rows]
        super().select(rows)

    def _append(self, row: int, tokens: Sequence[int]) -> None:
        if (prediction := self.predictions[row]) is not None:  # the answer moves its place; no text is kept
            prediction.follow(tokens)

    def candidate(self, row: int, cap: int) -> Candidate | None:
        prediction = self.predictions[row]
        if prediction is None or prediction.place is None or prediction.place >= len(prediction.tokens):
            return None
        bucket = run_bucket(prediction.run, (match_class(prediction.run), self.outcomes[row]))
        return Candidate(prediction.tokens[prediction.place:prediction.place + cap], bucket,
                         self.acceptance.rate(bucket))


def prediction_tokens(prediction: Sequence[int], answer: Sequence[int]) -> tuple[int, int]:
    """OpenAI's usage counts for a prediction: (accepted, rejected) = the prediction's tokens that appear in the
    answer (in order: the matching blocks of a diff of the two token lists), and the rest of them."""
    matcher = SequenceMatcher(None, list(prediction), list(answer), autojunk=False)
    accepted = sum(block.size for block in matcher.get_matching_blocks())
    return accepted, len(prediction) - accepted

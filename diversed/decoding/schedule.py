"""How many tokens the draft proposes each round."""

from __future__ import annotations

from dataclasses import dataclass

from diversed.theory import expected_tokens_per_round

SCHEDULES = ("constant", "heuristic", "auto")


@dataclass(frozen=True)
class DraftLength:
    """The draft length N and how it changes between rounds.

    constant: N every round. heuristic (transformers' schedule): +2 after a round in which the drafts were
    all kept, -1 (not below 1) otherwise; in a batch, a round counts as fully kept when at least half of the
    sequences kept all their drafts, since the batch shares one N. auto: each round, the N in
    [1, maximum] that the speed model predicts to give the most tokens per second, from this run's measured
    draft step and verify pass times and its running acceptance (see SpeedModel); N is the first round's.
    confidence: a sequence stops drafting in a round once its drafted token had draft probability below
    this (the token itself is still proposed); 0 disables it.
    """

    initial: int = 5
    schedule: str = "constant"
    maximum: int = 16
    confidence: float = 0.0

    def __post_init__(self) -> None:
        if self.initial < 1 or (self.schedule != "constant" and self.initial > self.maximum):
            raise ValueError(f"draft length must be in [1, {self.maximum}], got {self.initial}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"draft-length schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if not 0.0 <= self.confidence < 1.0:
            raise ValueError(f"draft confidence threshold must be in [0, 1), got {self.confidence}")

    def __str__(self) -> str:
        """"5", "20, cut-off 0.4", "auto from 5": for tables and headers."""
        length = str(self.initial) if self.schedule == "constant" else f"{self.schedule} from {self.initial}"
        return length + (f", cut-off {self.confidence}" if self.confidence else "")

    @property
    def longest(self) -> int:
        """The longest round this schedule can draft."""
        return self.initial if self.schedule == "constant" else self.maximum

    def next(self, n: int, fully_kept_fraction: float) -> int:
        """The heuristic and constant schedules' draft length of the next round, after a round of length n."""
        if self.schedule == "constant":
            return n
        return min(n + 2, self.maximum) if fully_kept_fraction >= 0.5 else max(n - 1, 1)


# What generate() and `diversed generate` draft by default: 20 tokens a round, a sequence stopping early
# once its draft is less than 40% sure (transformers' assisted-generation defaults too). The fastest
# setting measured on the default pair, at T = 0 and T = 1 (benchmarks/README.md).
DEFAULT_DRAFTING = DraftLength(20, confidence=0.4)


class SpeedModel:
    """The running speed model of one decoding call, for the "auto" schedule.

    Tokens per second of a round of N drafts = tau(a, N) / (N d + v(N + 1)) (theory.expected_tokens_per_round
    for tau): a the per-position acceptance, d the draft step time, v(k) = v0 + v1 k the target's forward
    time over k tokens. All three are estimated from the rounds so far, with older rounds weighing less
    (`decay` per round), since acceptance drifts within a text (code, then prose). The acceptance is the
    maximum-likelihood estimate for geometric runs: kept drafts / (kept drafts + rejections), starting from
    `prior_drafts` pseudo-drafts at `prior_acceptance`. Until two different verify lengths have been timed,
    v1 is taken as 0: that overestimates long rounds, so the next round is long, which gives the second point
    of the line.
    """

    def __init__(self, maximum: int, decay: float = 0.9, prior_acceptance: float = 0.8, prior_drafts: float = 8.0
                 ) -> None:
        self.maximum, self.decay = maximum, decay
        self.kept, self.rejections = prior_acceptance * prior_drafts, (1 - prior_acceptance) * prior_drafts
        self.draft_time = self.draft_steps = 0.0
        self.verify = [0.0] * 5  # decayed sums: weight, k, k^2, t, k t (a weighted least-squares line)

    def observe(self, kept: list[int], drafted: list[int], draft_steps: int, draft_seconds: float,
                verify_tokens: int, verify_seconds: float) -> None:
        """Record one round: per-sequence kept and drafted counts, the draft forwards and their total time,
        and the target pass's length (tokens per sequence) and time."""
        g = self.decay
        self.kept = g * self.kept + sum(kept)
        self.rejections = g * self.rejections + sum(k < d for k, d in zip(kept, drafted, strict=True))
        self.draft_time, self.draft_steps = g * self.draft_time + draft_seconds, g * self.draft_steps + draft_steps
        k, t = float(verify_tokens), verify_seconds
        self.verify = [g * s + x for s, x in zip(self.verify, (1.0, k, k * k, t, k * t), strict=True)]

    @property
    def acceptance(self) -> float:
        return self.kept / (self.kept + self.rejections)

    def verify_line(self) -> tuple[float, float]:
        """(v0, v1) of the target's pass time v0 + v1 k, v1 >= 0."""
        w, sk, skk, st, skt = self.verify
        spread = w * skk - sk * sk
        slope = max((w * skt - sk * st) / spread, 0.0) if spread > 1e-9 * max(w * skk, 1e-30) else 0.0
        return max(st / w - slope * sk / w, 0.0), slope

    def tokens_per_second(self, n: int) -> float:
        """Predicted tokens per second (per sequence) of a round of n drafts."""
        v0, v1 = self.verify_line()
        step = self.draft_time / self.draft_steps
        return expected_tokens_per_round([self.acceptance] * n) / (n * step + v0 + v1 * (n + 1))

    def best_length(self) -> int:
        """The draft length with the most predicted tokens per second."""
        return max(range(1, self.maximum + 1), key=self.tokens_per_second)

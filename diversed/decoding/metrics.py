"""What a decoding run did, per sequence and in total (docs/algorithm.md section 5).

acceptance_rate = accepted draft tokens / drafted tokens.
tau = new tokens / target forwards after the prompt (one per round; the correction or bonus token counts).
per_position_acceptance[i] = P(draft i+1 kept | drafts 1..i kept),
the a_i of expected_tokens_per_round (decoding/schedule.py).
tokens_per_s = new tokens / wall time (model loading excluded; in a batch, until that sequence finished).
rule_tokens: new tokens the rule decided (kept drafts and corrections); target_tokens: those the target decided
alone (steps without drafts, and bonus tokens after fully kept drafts). They add up to new_tokens.
drafters: per drafter, the tokens it drafted and how many were kept.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SequenceStats:
    """Counters for one generated sequence."""

    new_tokens: int = 0
    target_forwards: int = 0
    draft_forwards: int = 0
    drafted: int = 0
    accepted: int = 0
    reached: list[int] = field(default_factory=list)  # rounds in which position i was drafted and verified
    kept: list[int] = field(default_factory=list)  # rounds in which position i was kept
    wall_time: float = 0.0
    finish_reason: str = ""  # "eos", "stop", "length"; a server's job also "cancelled" or "error"
    rule_tokens: int = 0
    target_tokens: int = 0
    drafters: dict[str, list[int]] = field(default_factory=dict)  # name -> [drafted, kept]
    cached_tokens: int = 0  # prompt tokens the target's prompt cache held (not read again)

    def add_round(self, drafted: int, accepted: int, draft_forwards: int, drafter: str | None = None) -> None:
        """Record one round in which `drafted` drafts (by `drafter`) were offered and the first `accepted` kept."""
        self.target_forwards += 1
        self.draft_forwards += draft_forwards
        self.drafted += drafted
        self.accepted += accepted
        if drafter is not None and drafted:
            counts = self.drafters.setdefault(drafter, [0, 0])
            counts[0] += drafted
            counts[1] += accepted
        reached = min(accepted + 1, drafted)
        grow = max(0, drafted - len(self.reached))
        self.reached += [0] * grow
        self.kept += [0] * grow
        for i in range(reached):
            self.reached[i] += 1
        for i in range(accepted):
            self.kept[i] += 1

    def count_deciders(self, written: int, kept: int, drafted: int) -> None:
        """Of a round's `written` new tokens (kept drafts, then the next token, cut where the sequence ended),
        count those the rule decided and the one the target decided alone (a bonus, or a step without drafts)."""
        by_rule = min(written, kept) + (written > kept and kept < drafted)
        self.rule_tokens += by_rule
        self.target_tokens += written - by_rule

    def to_dict(self) -> dict:
        """All counters plus the derived rates."""
        return {
            "new_tokens": self.new_tokens,
            "wall_time": self.wall_time,
            "tokens_per_s": _ratio(self.new_tokens, self.wall_time),
            "acceptance_rate": _ratio(self.accepted, self.drafted),
            "tau": _ratio(self.new_tokens, self.target_forwards),
            "drafted": self.drafted,
            "accepted": self.accepted,
            "target_forwards": self.target_forwards,
            "draft_forwards": self.draft_forwards,
            "per_position_acceptance": [_ratio(k, r) for k, r in zip(self.kept, self.reached, strict=True)],
            "rule_tokens": self.rule_tokens,
            "target_tokens": self.target_tokens,
            "drafters": {name: {"drafted": d, "accepted": a} for name, (d, a) in sorted(self.drafters.items())},
            "finish_reason": self.finish_reason,
            "cached_tokens": self.cached_tokens,
        }


def summarize(stats: list[SequenceStats], wall_time: float) -> dict:
    """Totals over sequences decoded together; tokens_per_s uses the batch's wall time."""
    total = SequenceStats(wall_time=wall_time)
    for s in stats:
        total.new_tokens += s.new_tokens
        total.target_forwards += s.target_forwards
        total.draft_forwards += s.draft_forwards
        total.drafted += s.drafted
        total.accepted += s.accepted
        total.rule_tokens += s.rule_tokens
        total.target_tokens += s.target_tokens
        for name, (drafted, kept) in s.drafters.items():
            counts = total.drafters.setdefault(name, [0, 0])
            counts[0] += drafted
            counts[1] += kept
        grow = max(0, len(s.reached) - len(total.reached))
        total.reached += [0] * grow
        total.kept += [0] * grow
        for i, (r, k) in enumerate(zip(s.reached, s.kept, strict=True)):
            total.reached[i] += r
            total.kept[i] += k
    summary = total.to_dict()
    del summary["finish_reason"]
    summary["sequences"] = len(stats)
    return summary


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None

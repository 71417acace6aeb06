"""How each new token was made: a request's provenance, token by token (docs/algorithm.md section 5).

A token is one of
  kept        a draft the rule kept that exact would have kept too, on the same draw;
  relaxed     a draft the rule kept that exact would have rejected on the same draw (u >= min(1, p(x)/q(x)), or
              in greedy mode x != argmax p): what a relaxed rule buys, and its cost;
  correction  the token after the first rejected draft, drawn from the rule's residual;
  bonus       the target's token after a round whose drafts were all kept;
  target      a token of the target alone (a round in which this row drafted nothing).
Typical acceptance draws nothing, so none of its kept drafts is "relaxed" (its exact_acceptance still says
how exact would have judged each one).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from torch import Tensor

from diversed.verify import exact_acceptance

ORIGINS = ("kept", "relaxed", "correction", "bonus", "target")


@dataclass(frozen=True)
class TokenOrigin:
    """One new token's origin (ORIGINS). round: the target pass that wrote it, counted from 1; drafted: the
    drafts that pass verified for this row (0 for the target alone; the same for every token of a round); p: the
    target's probability of the token at its place (its sampling distribution: temperature, top-k, top-p); drafter: who
    drafted it (kept, relaxed), the rejected draft (correction) or the round's drafts (bonus); q: the drafter's
    probability of the drafted token (1 for copied text), acceptance and exact_acceptance: the probability that
    the rule and exact keep that draft; rejected_token_id: the rejected draft (correction)."""

    origin: str
    round: int
    drafted: int
    p: float
    drafter: str | None = None
    q: float | None = None
    acceptance: float | None = None
    exact_acceptance: float | None = None
    rejected_token_id: int | None = None


def records(tokenizer, tokens: list[int], texts: list[str], origins: list[TokenOrigin]) -> list[dict]:
    """The JSON form of tokens' origins (a server's and generate()'s provenance): each with the token's text
    (diversed.text.TokenTexts) and id, and a correction's rejected draft as text too."""
    out = []
    for token, text, origin in zip(tokens, texts, origins, strict=True):
        fields = asdict(origin)
        for key in ("p", "q", "acceptance", "exact_acceptance"):
            fields[key] = None if fields[key] is None else round(fields[key], 6)
        rejected = origin.rejected_token_id
        out.append({"token": text, "token_id": token, **fields,
                    "rejected": None if rejected is None else tokenizer.decode([rejected])})
    return out


def round_origins(drafts: Tensor, q: Tensor | None, p: Tensor, accept_prob: Tensor, uniform: Tensor, next_token: int,
                  kept: int, greedy: bool, drafter: str | None, round: int) -> list[TokenOrigin]:
    """One row's new tokens of a speculative round: of its drafts [L] (with q [L, V] or None for copied ones,
    p [L + 1, V], and the
    verifier's accept_prob and uniform draws [L]) the first `kept`, then next_token."""
    length = len(drafts)
    if length == 0:
        return [target_origin(float(p[0, next_token]), round)]
    here = (round, length)
    exact = exact_acceptance(drafts[None], None if q is None else q[None], p[None], greedy)[0].tolist()
    x = drafts.tolist()
    positions = range(length)
    p_x = p[positions, x].tolist()
    q_x = [1.0] * length if q is None else q[positions, x].tolist()
    rule, draws = accept_prob.tolist(), uniform.tolist()
    origins = [TokenOrigin("relaxed" if draws[i] >= exact[i] else "kept", *here, p_x[i], drafter, q_x[i], rule[i],
                           exact[i]) for i in range(kept)]
    if kept == length:
        return origins + [TokenOrigin("bonus", *here, float(p[length, next_token]), drafter)]
    return origins + [TokenOrigin("correction", *here, float(p[kept, next_token]), drafter, q_x[kept], rule[kept],
                                  exact[kept], x[kept])]


def target_origin(p: float, round: int) -> TokenOrigin:
    """A token of the target alone, with its probability p."""
    return TokenOrigin("target", round, 0, p)

"""Closed forms of docs/algorithm.md section 2.6, for the tests to hold diversed.verify's samples and the
speed model against: the distribution each rule verifies against, its acceptance probability, the static
ensemble's acceptance, bias and Pareto front, and Leviathan et al.'s speedup with the verify pass's cost."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from diversed.verify import RULES, Rule, _target, total_variation


def expected_tokens_per_round(acceptance: Sequence[float] | Tensor) -> float:
    """Expected tokens emitted per round (tau) given per-position acceptance a_1..a_N:
    1 + sum_k prod_{i<=k} a_i (the +1 is the correction or bonus token)."""
    a = torch.as_tensor(acceptance, dtype=torch.float64)
    return float(1.0 + a.cumprod(0).sum())


def verification_target(rule: str, p: Tensor, q: Tensor, *, draft: Tensor | None = None,
                        **params: float | Tensor) -> Tensor:
    """The distribution pi that a rule verifies against, for p, q of shape [..., V] (RULES[rule].target):
    p for "exact", "lossy" and "lossy-entropy"; nu = w p + (1 - w) q for "static"/"dynamic" (w broadcast over
    the leading dimensions); the deferral rule's pi for the cascades and "judi"; for "cactus", h_x, p with the
    drafted token x raised, so it needs `draft`, long [...]. This is also each rule's output distribution,
    except where the test is relaxed ("lossy", "lossy-entropy") and for "cactus", whose target moves with x
    (its output: docs/algorithm.md section 9)."""
    spec = _with_target(rule)
    if spec.raise_draft is not None and draft is None:
        raise ValueError(f"rule {rule!r} raises the drafted token in its target: pass draft")
    return _target(spec, p, q, draft, {**spec.defaults, **params})


def acceptance_probability(rule: str, p: Tensor, q: Tensor, **params: float | Tensor) -> Tensor:
    """Probability that a draft x ~ q passes the rule's test at one position: sum_x min(q(x), a(x)), a(x) the
    mass that keeps a drafted x: pi(x), over relax where the test is relaxed, and the raised mass where the
    target moves with x (cactus); i.e. 1 - TV(q, pi) when neither (docs/algorithm.md section 2.6). p, q:
    [..., V]."""
    spec = _with_target(rule)
    params = {**spec.defaults, **params}
    kept = spec.target(p, q, **params)
    if spec.raise_draft is not None:
        kept = spec.raise_draft(kept, **params)  # elementwise: what each token would get, were it the draft
    if spec.relax is not None:
        kept = kept / torch.as_tensor(spec.relax(p, **params), dtype=p.dtype, device=p.device).unsqueeze(-1)
    return torch.minimum(q, kept).sum(-1)


def _with_target(rule: str) -> Rule:
    if rule not in RULES or RULES[rule].target is None:
        raise ValueError(f"rule {rule!r} has no verification target; choose one of "
                         f"{[name for name, r in RULES.items() if r.target is not None]}")
    return RULES[rule]


def first_two_token_marginals(target, prompt: list[int]) -> tuple[Tensor, Tensor]:
    """What the target itself writes after `prompt` (a transformers causal LM, no sampling warpers): the first
    token's p(t1) and the second's marginal sum_t1 p(t1) p(t2 | t1), each [V]."""
    with torch.no_grad():
        p1 = torch.softmax(target(torch.tensor([prompt])).logits[0, -1], -1)
        vocab = p1.shape[-1]
        seqs = torch.cat([torch.tensor([prompt]).expand(vocab, len(prompt)), torch.arange(vocab)[:, None]], 1)
        p2 = (p1[:, None] * torch.softmax(target(seqs).logits[:, -1], -1)).sum(0)
    return p1, p2


def ensemble_acceptance(p: Tensor, q: Tensor, weight: float | Tensor) -> Tensor:
    """Acceptance probability of the ensemble nu = w p + (1-w) q: 1 - w TV(q, p)."""
    return 1.0 - torch.as_tensor(weight) * total_variation(q, p)


def ensemble_bias(p: Tensor, q: Tensor, weight: float | Tensor) -> Tensor:
    """Distance of the ensemble's output from the target's: TV(nu, p) = (1 - w) TV(q, p)."""
    return (1.0 - torch.as_tensor(weight)) * total_variation(q, p)


def pareto_front(p: Tensor, q: Tensor, weights: Tensor) -> tuple[Tensor, Tensor]:
    """(rejection probability, bias) of the static ensemble at each w in `weights`, for one pair p, q [V].

    Every point satisfies rejection + bias = TV(q, p), the lower-left boundary that no verifier can cross
    (Proposition 1): so the static ensemble sweeps the whole Pareto front as w goes from 0 to 1.
    """
    tv = total_variation(q, p)
    return weights * tv, (1.0 - weights) * tv


def expected_speedup(acceptance: float, draft_len: int, draft_cost: float, verify_cost: float = 1.0) -> float:
    """Speedup over plain target decoding, Leviathan et al.'s model extended with the verify pass's cost.

    Args:
        acceptance: i.i.d. per-position acceptance a.
        draft_len: N drafts per round.
        draft_cost: c = (draft step time) / (target step time).
        verify_cost: (target forward over N+1 tokens) / (target step time); 1 gives Leviathan's formula
            (1 - a^(N+1)) / ((1 - a)(N c + 1)). On a CPU it is measurably above 1.
    """
    return expected_tokens_per_round([acceptance] * draft_len) / (draft_len * draft_cost + verify_cost)

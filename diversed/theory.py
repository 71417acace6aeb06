"""Closed forms for speculative decoding (docs/algorithm.md section 2.6): acceptance, bias, the Pareto front of
(rejection, bias), expected tokens per round, and the speed model."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from diversed.verify import total_variation


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


def expected_tokens_per_round(acceptance: Sequence[float] | Tensor) -> float:
    """Expected tokens emitted per round (tau) given per-position acceptance a_1..a_N:
    1 + sum_k prod_{i<=k} a_i (the +1 is the correction or bonus token)."""
    a = torch.as_tensor(acceptance, dtype=torch.float64)
    return float(1.0 + a.cumprod(0).sum())


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

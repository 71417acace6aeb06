"""Verification rules for speculative decoding, as pure tensor functions.

A verifier sees a block of N drafted tokens, the draft's distributions q_1..q_N that produced them and the
target's distributions p_1..p_{N+1} from one forward pass. It keeps a prefix of the drafts and emits one more
token: a correction at the first rejection, or a bonus token from p_{N+1} when all N were kept. It knows
nothing about models: tensors and a random generator in, decisions out.

All rules but "typical" share one shape (ALGORITHM.md section 2): each defines a verification target pi_i,
accepts x_i with probability min(1, pi_i(x_i) / q_i(x_i)), stops at the first rejection and draws the
correction from norm(max(0, pi_i - q_i)). Every emitted non-bonus token is then distributed exactly as pi_i.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from diversed.decoding.sampling import draw

RULES = ("exact", "lossy", "static", "dynamic", "cascade-chow", "cascade-opt", "cascade-token", "typical")

# Medusa's defaults for typical acceptance (posterior threshold 0.09, alpha 0.3).
TYPICAL_EPSILON = 0.09
TYPICAL_DELTA = 0.3

_PROB_TOLERANCE = 1e-3  # float32 softmaxes over 150k tokens sum to 1 within ~1e-5; bf16 inputs are upcast


@dataclass(frozen=True)
class Verification:
    """What a verifier decided for a batch of B drafted blocks of length N."""

    num_accepted: Tensor  # long [B], in 0..N: how many drafts are kept
    next_token: Tensor  # long [B]: the correction at the first rejection, or the bonus token
    accepted: Tensor  # bool [B, N]: the kept prefix, True for positions < num_accepted
    accept_prob: Tensor  # float [B, N]: probability each draft passes its own test (0 or 1 when deterministic)


def verify(
    rule: str,
    draft_tokens: Tensor,
    draft_probs: Tensor,
    target_probs: Tensor,
    *,
    weight: float | Tensor | None = None,
    lenience: float | None = None,
    alpha: float | None = None,
    epsilon: float | None = None,
    delta: float | None = None,
    greedy: bool = False,
    generator: torch.Generator | None = None,
    validate: bool = True,
) -> Verification:
    """Decide how many drafted tokens to keep and which token comes next, for a batch of blocks.

    Args:
        rule: one of RULES.
        draft_tokens: long [B, N], the drafted tokens (x_i ~ q_i, or argmax q_i in greedy mode).
        draft_probs: [B, N, V], q_i, already tempered / top-k / top-p filtered.
        target_probs: [B, N+1, V], p_i, processed the same way.
        weight: w, the weight on the target: a float in [0, 1] for "static", a [B, N] tensor for "dynamic".
        lenience: l in [0, 1) for "lossy".
        alpha: the deferral parameter in [0, 1] of the cascade rules.
        epsilon, delta: thresholds of "typical" (defaults TYPICAL_EPSILON, TYPICAL_DELTA).
        greedy: accept iff the draft equals argmax pi_i; the correction is argmax pi_i, the bonus argmax p.
            ("lossy" verifies against p, so greedy lossy is greedy exact.)
        generator: the source of randomness in sampling mode, for reproducible runs.
        validate: check shapes, ranges and that the probabilities are distributions (a few ms on large V).

    Returns:
        A Verification. No Python loop over the batch: every sequence is decided at once.
    """
    if validate:
        _check_inputs(rule, draft_tokens, draft_probs, target_probs, weight, lenience, alpha, epsilon, delta)
    q = draft_probs.float()
    p = target_probs.float()
    n = draft_tokens.shape[1]
    if rule == "typical":
        return _typical(draft_tokens, p, greedy, generator,
                        TYPICAL_EPSILON if epsilon is None else epsilon, TYPICAL_DELTA if delta is None else delta)

    pi = verification_target(rule, p[:, :n], q, weight=weight, alpha=alpha)
    if greedy:
        target_choice = pi.argmax(-1)
        passed = draft_tokens == target_choice
        accept_prob = passed.float()
    else:
        pi_x = pi.gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)
        q_x = q.gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)
        if rule == "lossy":
            q_x = (1.0 - lenience) * q_x
        # q(x) = 0 cannot be drafted by sampling; if it is given anyway, accept iff pi(x) > 0.
        accept_prob = (pi_x / q_x.clamp_min(torch.finfo(q_x.dtype).tiny)).clamp(max=1.0)
        passed = torch.rand(accept_prob.shape, generator=generator, device=accept_prob.device) < accept_prob

    accepted = passed.long().cumprod(-1).bool()
    num_accepted = accepted.sum(-1)
    stopped = num_accepted.clamp(max=n - 1)  # the rejected position (unused where all N were kept)
    rows = torch.arange(len(num_accepted), device=num_accepted.device)
    all_kept = num_accepted == n
    if greedy:
        correction = target_choice[rows, stopped]
        next_token = torch.where(all_kept, p[:, n].argmax(-1), correction)
    else:
        # For the ensembles nu - q = w (p - q): the same residual as p - q for every w > 0, and p - q does
        # not lose precision to cancellation when w is small.
        corrected = p[:, :n] if rule in ("static", "dynamic") else pi
        residual = _residual(corrected[rows, stopped], q[rows, stopped])
        next_dist = torch.where(all_kept.unsqueeze(-1), p[:, n], residual)
        next_token = draw(next_dist, generator)
    return Verification(num_accepted, next_token, accepted, accept_prob)


def verification_target(
    rule: str, p: Tensor, q: Tensor, *, weight: float | Tensor | None = None, alpha: float | None = None
) -> Tensor:
    """The distribution pi that a rule verifies against, for p, q of shape [..., V].

    "exact" and "lossy" verify against p; "static"/"dynamic" against nu = w p + (1 - w) q (w broadcast over
    the leading dimensions); the cascades against their deferral rule's pi. This is also each rule's
    output distribution, except for "lossy", whose ratio test is relaxed.
    """
    if rule in ("exact", "lossy"):
        return p
    if rule in ("static", "dynamic"):
        w = torch.as_tensor(weight, dtype=p.dtype, device=p.device)
        w = w.unsqueeze(-1) if w.dim() else w  # a weight per position broadcasts over the vocabulary
        return w * p + (1.0 - w) * q
    if rule == "cascade-chow":
        defer_to_draft = q.amax(-1) >= 1.0 - alpha
        return torch.where(defer_to_draft.unsqueeze(-1), q, p)
    if rule == "cascade-opt":
        defer_to_draft = q.amax(-1) >= p.amax(-1) - alpha * total_variation(q, p)
        return torch.where(defer_to_draft.unsqueeze(-1), q, p)
    if rule == "cascade-token":
        allowed = p >= (1.0 - alpha) * p.amax(-1, keepdim=True)
        q_allowed = q * allowed
        return q_allowed + (1.0 - q_allowed.sum(-1, keepdim=True)) * p
    raise ValueError(f"rule {rule!r} has no verification target; choose one of {RULES}")


def total_variation(a: Tensor, b: Tensor) -> Tensor:
    """TV(a, b) = 0.5 * sum_x |a(x) - b(x)| over the last dimension."""
    return 0.5 * (a - b).abs().sum(-1)


def _residual(pi: Tensor, q: Tensor) -> Tensor:
    """norm(max(0, pi - q)); pi itself where that is all zero (pi == q up to rounding: rejection had
    probability ~0, and pi is then the right distribution to fall back on)."""
    excess = (pi - q).clamp_min(0.0)
    mass = excess.sum(-1, keepdim=True)
    return torch.where(mass > 0, excess / mass.clamp_min(torch.finfo(mass.dtype).tiny), pi)


def _typical(draft_tokens: Tensor, p: Tensor, greedy: bool, generator: torch.Generator | None,
             epsilon: float, delta: float) -> Verification:
    """Typical acceptance (Medusa): keep x_i iff p_i(x_i) > min(epsilon, delta * exp(-H(p_i)))."""
    n = draft_tokens.shape[1]
    p_draft = p[:, :n]
    entropy = torch.special.entr(p_draft).sum(-1)
    threshold = torch.minimum(torch.full_like(entropy, epsilon), delta * torch.exp(-entropy))
    passed = p_draft.gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1) > threshold
    accepted = passed.long().cumprod(-1).bool()
    num_accepted = accepted.sum(-1)
    next_dist = p[torch.arange(len(num_accepted), device=p.device), num_accepted]  # p_{j}, j = first reject
    if greedy:
        next_token = next_dist.argmax(-1)
    else:
        next_token = draw(next_dist, generator)
    return Verification(num_accepted, next_token, accepted, passed.float())


def _check_inputs(rule, draft_tokens, draft_probs, target_probs, weight, lenience, alpha, epsilon, delta):
    if draft_tokens.dim() != 2 or draft_tokens.dtype != torch.long:
        raise ValueError(f"draft_tokens must be a long tensor [B, N], got {draft_tokens.dtype} "
                         f"{tuple(draft_tokens.shape)}")
    b, n = draft_tokens.shape
    if n == 0:
        raise ValueError("draft_tokens has N = 0 drafted tokens: nothing to verify")
    if draft_probs.dim() != 3 or tuple(draft_probs.shape[:2]) != (b, n):
        raise ValueError(f"draft_probs must be [B, N, V] = [{b}, {n}, V], got {tuple(draft_probs.shape)}")
    v = draft_probs.shape[2]
    if tuple(target_probs.shape) != (b, n + 1, v):
        raise ValueError(f"target_probs must be [B, N+1, V] = [{b}, {n + 1}, {v}] (same vocabulary as "
                         f"draft_probs), got {tuple(target_probs.shape)}")
    if draft_tokens.numel() and (draft_tokens.min() < 0 or draft_tokens.max() >= v):  # B = 0 is a valid batch
        raise ValueError(f"draft_tokens must be token ids in [0, {v}), got values in "
                         f"[{int(draft_tokens.min())}, {int(draft_tokens.max())}]")
    for name, probs in (("draft_probs", draft_probs), ("target_probs", target_probs)):
        probs = probs.float()
        if not torch.isfinite(probs).all():
            raise ValueError(f"{name} contains NaN or infinite values")
        if (probs < 0).any():
            raise ValueError(f"{name} contains negative probabilities")
        worst = (probs.sum(-1) - 1.0).abs().max() if probs.numel() else 0.0
        if worst > _PROB_TOLERANCE:
            raise ValueError(f"{name} rows must sum to 1 (within {_PROB_TOLERANCE}); one is off by {worst:.3g}")
    check_parameters(rule, weight=weight, lenience=lenience, alpha=alpha, epsilon=epsilon, delta=delta,
                     shape=(b, n))


def check_parameters(rule: str, *, weight: float | Tensor | None = None, lenience: float | None = None,
                     alpha: float | None = None, epsilon: float | None = None, delta: float | None = None,
                     shape: tuple[int, int] | None = None) -> None:
    """Raise ValueError unless the rule gets exactly its parameters, in range. `shape` (B, N) is the shape
    a "dynamic" weight tensor must have (unchecked when None)."""
    if rule not in RULES:
        raise ValueError(f"rule must be one of {RULES}, got {rule!r}")
    needs = {"static": "weight", "dynamic": "weight", "lossy": "lenience", "cascade-chow": "alpha",
             "cascade-opt": "alpha", "cascade-token": "alpha"}
    given = {"weight": weight, "lenience": lenience, "alpha": alpha, "epsilon": epsilon, "delta": delta}
    allowed = {needs[rule]} if rule in needs else ({"epsilon", "delta"} if rule == "typical" else set())
    for name, value in given.items():
        if value is not None and name not in allowed:
            raise ValueError(f"{name} does not apply to rule {rule!r}")
    if rule in needs and given[needs[rule]] is None:
        raise ValueError(f"rule {rule!r} needs {needs[rule]}")

    if rule == "static":
        w = torch.as_tensor(weight, dtype=torch.float32)
        if w.dim() != 0:
            raise ValueError(f"weight for 'static' must be a single number, got shape {tuple(w.shape)}; "
                             "use rule 'dynamic' for a weight per position")
        _check_unit_interval("weight", w)
    if rule == "dynamic":
        if not isinstance(weight, Tensor) or (shape is not None and tuple(weight.shape) != shape):
            got = tuple(weight.shape) if isinstance(weight, Tensor) else type(weight).__name__
            raise ValueError(f"weight for 'dynamic' must be a tensor [B, N] = {list(shape or ())}, got {got}")
        _check_unit_interval("weight", weight.float())
    if rule == "lossy" and not 0.0 <= lenience < 1.0:
        raise ValueError(f"lenience must be in [0, 1), got {lenience}")
    if rule.startswith("cascade") and not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    for name in ("epsilon", "delta"):
        if given[name] is not None and not given[name] > 0:
            raise ValueError(f"{name} must be positive, got {given[name]}")


def _check_unit_interval(name: str, value: Tensor) -> None:
    if not torch.isfinite(value).all() or (value < 0).any() or (value > 1).any():
        raise ValueError(f"{name} must be in [0, 1], got values in [{value.min():.4g}, {value.max():.4g}]")

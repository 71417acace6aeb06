"""Verification rules for speculative decoding, as pure tensor functions.

A verifier sees a block of N drafted tokens, the draft's distributions q_1..q_N that produced them and the
target's distributions p_1..p_{N+1} from one forward pass. It keeps a prefix of the drafts and emits one more
token: a correction at the first rejection, or a bonus token from p_{N+1} when all N were kept. It knows
nothing about models: tensors and a random generator in, decisions out.

All rules but "typical" share one shape (docs/algorithm.md section 2.1): each defines a verification target pi_i,
accepts x_i with probability min(1, pi_i(x_i) / q_i(x_i)), stops at the first rejection and draws the
correction from norm(max(0, pi_i - q_i)). Every emitted non-bonus token is then distributed exactly as pi_i.

Every rule is declared once, in RULES: its name, its parameters, its verification target, and where it
departs from the shared shape. Adding a rule of that shape is one entry there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

# Medusa's defaults for typical acceptance (posterior threshold 0.09, alpha 0.3).
TYPICAL_EPSILON = 0.09
TYPICAL_DELTA = 0.3


@dataclass(frozen=True)
class Rule:
    """A verification rule.

    parameters: the keyword arguments of verify() it takes (the first is the one "name:value" sets);
    optional: whether they may be left out (typical's have Medusa's defaults).
    target(p, q, **parameters): pi, what its ratio test verifies against and what its output follows; None
    for a rule with a test of its own (typical).
    relax(**parameters): accept with min(1, pi / (relax q)) instead of min(1, pi / q) (lossy's lenience).
    correct_from_p: draw the correction from norm(max(0, p - q)); for the ensembles it is the same
    distribution as norm(max(0, nu - q)) for every w > 0 (nu - q = w (p - q)), without the cancellation.
    """

    name: str
    summary: str
    parameters: tuple[str, ...] = ()
    optional: bool = False
    target: Callable[..., Tensor] | None = None
    relax: Callable[..., float] | None = None
    correct_from_p: bool = False


def _mixture(p: Tensor, q: Tensor, weight: float | Tensor) -> Tensor:
    w = torch.as_tensor(weight, dtype=p.dtype, device=p.device)
    w = w.unsqueeze(-1) if w.dim() else w  # a weight per position broadcasts over the vocabulary
    return w * p + (1.0 - w) * q


def _chow(p: Tensor, q: Tensor, alpha: float) -> Tensor:
    return torch.where((q.amax(-1) >= 1.0 - alpha).unsqueeze(-1), q, p)


def _opt(p: Tensor, q: Tensor, alpha: float) -> Tensor:
    return torch.where((q.amax(-1) >= p.amax(-1) - alpha * total_variation(q, p)).unsqueeze(-1), q, p)


def _token(p: Tensor, q: Tensor, alpha: float) -> Tensor:
    q_allowed = q * (p >= (1.0 - alpha) * p.amax(-1, keepdim=True))
    return q_allowed + (1.0 - q_allowed.sum(-1, keepdim=True)) * p


RULES: dict[str, Rule] = {rule.name: rule for rule in (
    Rule("exact", "p: lossless (Leviathan et al., Chen et al.)", target=lambda p, q: p),
    Rule("lossy", "accept with min(1, p/((1-l) q)), correct from norm(max(0, p - q))", ("lenience",),
         target=lambda p, q, lenience=None: p, relax=lambda lenience: 1.0 - lenience),
    Rule("static", "w p + (1-w) q, one w", ("weight",), target=_mixture, correct_from_p=True),
    Rule("dynamic", "w_i p + (1-w_i) q, a w per sequence and position (the DIVERSED head)", ("weight",),
         target=_mixture, correct_from_p=True),
    Rule("cascade-chow", "q if max q >= 1 - a, else p", ("alpha",), target=_chow),
    Rule("cascade-opt", "q if max q >= max p - a TV(q, p), else p", ("alpha",), target=_opt),
    Rule("cascade-token", "q on the tokens p rates within (1 - a) of its best, the rest of the mass on p",
         ("alpha",), target=_token),
    Rule("typical", "deterministic: accept iff p(x) > min(eps, delta exp(-H(p))) (Medusa)", ("epsilon", "delta"),
         optional=True),
)}


def _unit_interval(value) -> bool:
    value = torch.as_tensor(value, dtype=torch.float32)
    return bool(torch.isfinite(value).all() and (value >= 0).all() and (value <= 1).all())


# The range of each parameter: a test and what it says when the value fails it.
PARAMETER_RANGES: dict[str, tuple[Callable[[object], bool], str]] = {
    "weight": (_unit_interval, "in [0, 1]"),
    "lenience": (lambda v: 0.0 <= v < 1.0, "in [0, 1)"),
    "alpha": (lambda v: 0.0 <= v <= 1.0, "in [0, 1]"),
    "epsilon": (lambda v: v > 0 and v < float("inf"), "positive and finite"),
    "delta": (lambda v: v > 0 and v < float("inf"), "positive and finite"),
}

_BLOCK = 512  # tokens per block of draw(); any size is exact, this one measured fastest for 152k tokens
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

    spec = RULES[rule]
    params = {k: v for k, v in (("weight", weight), ("lenience", lenience), ("alpha", alpha)) if k in spec.parameters}
    pi = spec.target(p[:, :n], q, **params)
    if greedy:
        target_choice = pi.argmax(-1)
        passed = draft_tokens == target_choice
        accept_prob = passed.float()
    else:
        pi_x = pi.gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)
        q_x = q.gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)
        if spec.relax is not None:
            q_x = spec.relax(**params) * q_x
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
        corrected = p[:, :n] if spec.correct_from_p else pi
        residual = _residual(corrected[rows, stopped], q[rows, stopped])
        next_dist = torch.where(all_kept.unsqueeze(-1), p[:, n], residual)
        next_token = draw(next_dist, generator)
    return Verification(num_accepted, next_token, accepted, accept_prob)


def verification_target(rule: str, p: Tensor, q: Tensor, **params: float | Tensor) -> Tensor:
    """The distribution pi that a rule verifies against, for p, q of shape [..., V] (RULES[rule].target):
    p for "exact" and "lossy"; nu = w p + (1 - w) q for "static"/"dynamic" (w broadcast over the leading
    dimensions); the deferral rule's pi for the cascades. This is also each rule's output distribution,
    except for "lossy", whose ratio test is relaxed."""
    if rule not in RULES or RULES[rule].target is None:
        raise ValueError(f"rule {rule!r} has no verification target; choose one of "
                         f"{[name for name, r in RULES.items() if r.target is not None]}")
    return RULES[rule].target(p, q, **params)


def acceptance_probability(rule: str, p: Tensor, q: Tensor, **params: float | Tensor) -> Tensor:
    """Probability that a draft x ~ q passes the rule's test at one position: sum_x min(q(x), pi(x) / relax),
    i.e. 1 - TV(q, pi) when nothing relaxes the test (docs/algorithm.md section 2.6). p, q: [..., V]."""
    pi = verification_target(rule, p, q, **params)
    relax = RULES[rule].relax
    return torch.minimum(q, pi / (relax(**params) if relax else 1.0)).sum(-1)


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
        raise ValueError(f"rule must be one of {tuple(RULES)}, got {rule!r}")
    spec = RULES[rule]
    given = {"weight": weight, "lenience": lenience, "alpha": alpha, "epsilon": epsilon, "delta": delta}
    for name, value in given.items():
        if value is None:
            if name in spec.parameters and not spec.optional:
                raise ValueError(f"rule {rule!r} needs {name}")
            continue
        if name not in spec.parameters:
            raise ValueError(f"{name} does not apply to rule {rule!r}")
        if name == "weight":
            _check_weight(rule, value, shape)
        test, accepted = PARAMETER_RANGES[name]
        if not test(value):
            raise ValueError(f"{name} must be {accepted}, got {_describe(value)}")


def _check_weight(rule: str, weight: float | Tensor, shape: tuple[int, int] | None) -> None:
    """A single number for "static"; a tensor [B, N], one w per sequence and position, for "dynamic"."""
    if rule == "static" and torch.as_tensor(weight).dim() != 0:
        shape_given = tuple(torch.as_tensor(weight).shape)
        raise ValueError(f"weight for 'static' must be a single number, got shape {shape_given}; use rule "
                         "'dynamic' for a weight per position")
    if rule == "dynamic" and (not isinstance(weight, Tensor) or (shape is not None and tuple(weight.shape) != shape)):
        got = tuple(weight.shape) if isinstance(weight, Tensor) else type(weight).__name__
        raise ValueError(f"weight for 'dynamic' must be a tensor [B, N] = {list(shape or ())}, got {got}")


def _describe(value) -> str:
    if isinstance(value, Tensor) and value.numel() > 1:
        return f"values in [{value.min():.4g}, {value.max():.4g}]"
    return f"{float(value):.4g}" if isinstance(value, Tensor) else repr(value)


def draw(probs: Tensor, generator: torch.Generator | None) -> Tensor:
    """One token per row of probs [B, V] (unnormalised weights >= 0) -> [B], exactly distributed.

    In two stages: a block of _BLOCK tokens by the block's mass, then a token within it by its weight, so
    P(token) = P(block) P(token | block) = probs[token] / sum. torch.multinomial over all 151,936 tokens
    costs 4 ms a row on a 2-core CPU, as much as 7% of an int8 draft step; the two small draws cost 0.3 ms.
    """
    rows, vocab = probs.shape
    if rows == 0:
        return torch.empty(0, dtype=torch.long, device=probs.device)
    if vocab <= _BLOCK:
        return torch.multinomial(probs.float(), 1, generator=generator).squeeze(-1)
    blocks = F.pad(probs.float(), (0, (-vocab) % _BLOCK)).view(rows, -1, _BLOCK)
    block = torch.multinomial(blocks.sum(-1), 1, generator=generator).squeeze(-1)
    within = blocks[torch.arange(rows, device=probs.device), block]
    return block * _BLOCK + torch.multinomial(within, 1, generator=generator).squeeze(-1)

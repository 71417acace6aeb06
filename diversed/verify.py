"""Verdict rules for speculative decoding, as pure tensor functions.

A verifier sees a block of N drafted tokens, the draft's distributions q_1..q_N that produced them and the
target's distributions p_1..p_{N+1} from one forward pass. It keeps a prefix of the drafts and emits one more
token: a correction at the first rejection, or a bonus token from p_{N+1} when all N were kept. It knows
nothing about models: tensors and a random generator in, decisions out.

All rules but "typical" share one shape (docs/algorithm.md section 2.1): each defines a verification target pi_i,
accepts x_i with probability min(1, pi_i(x_i) / q_i(x_i)), stops at the first rejection and draws the
correction from norm(max(0, pi_i - q_i)). Every emitted non-bonus token is then distributed exactly as pi_i.
A rule may depart from that shape in two declared ways: a relaxed test (lossy's lenience, and lossy-entropy's
where the target is uncertain), or a target that depends on the drafted token itself (cactus raises the
draft's own probability); their outputs are derived in docs/algorithm.md sections 2.6 and 9.

Every rule is declared once, in RULES: its name, its parameters, its verification target, and where it
departs from the shared shape. Adding a rule of that shape is one entry there.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from diversed.request import RULE_SPECS, RuleSpec, check_rule_parameters


@dataclass(frozen=True)
class Rule:
    """A verification rule's math; its name, parameters and their ranges are its RuleSpec
    (diversed.request.RULE_SPECS).

    target(p, q, **parameters): pi, what its ratio test verifies against and what its output follows; None
    for a rule with a test of its own (typical).
    raise_draft(pi_x, **parameters): for a target that depends on the drafted token x (cactus): the mass x gets
    in it, from its mass pi(x) in `target`; the other tokens keep their proportions (_target).
    relax(p, **parameters): accept with min(1, pi / (relax q)) instead of min(1, pi / q) (lossy's lenience): a
    number, or a tensor [...] with one per position (lossy-entropy's, from the entropy of p; lossy's, from a
    lenience per position).
    per_position: the parameters it also takes as a tensor [B, N], one per drafted token: what a trained head
    sets ("dynamic"'s weight, which it takes only so; lossy's lenience).
    correct_from_p: draw the correction from norm(max(0, p - q)); for the ensembles it is the same
    distribution as norm(max(0, nu - q)) for every w > 0 (nu - q = w (p - q)), without the cancellation.
    """

    spec: RuleSpec
    target: Callable[..., Tensor] | None = None
    raise_draft: Callable[..., Tensor] | None = None
    relax: Callable[..., float | Tensor] | None = None
    per_position: tuple[str, ...] = ()
    correct_from_p: bool = False

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def parameters(self) -> tuple[str, ...]:
        return self.spec.parameters

    @property
    def defaults(self) -> Mapping[str, float]:
        return self.spec.defaults


def _p(p: Tensor, q: Tensor, **_: float) -> Tensor:
    """The target itself: what exact verifies against, and where lossy's relaxed test and cactus's raised
    target start from."""
    return p


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


def _gated_lenience(p: Tensor, lenience: float, entropy_threshold: float) -> Tensor:
    """Lossy's 1 - l where the target is uncertain, H(p) >= the threshold, and 1 (the exact test) where it is
    sure: FLy's gate. Where the target is sure a disagreeing draft is an error; where it is not, a choice."""
    return 1.0 - lenience * (entropy(p) >= entropy_threshold).to(p.dtype)


def _cactus_mass(p_x: Tensor, delta: float) -> Tensor:
    """Hao & Mou's closed form: the most mass the drafted token can take from the others, in proportion, within
    a KL budget delta to second order. Moving p(x) to h that way costs chi^2 = (h - p(x))^2 / (p(x)(1 - p(x)))
    and KL = chi^2 / 2 + O((h - p(x))^3), so h = p(x) + sqrt(2 delta p(x)(1 - p(x))), at most 1."""
    spread = (p_x * (1.0 - p_x)).clamp_min(0.0)  # a p(x) rounded above 1 has none
    return (p_x + torch.sqrt(2.0 * delta * spread)).clamp(max=1.0)


def _judi(p: Tensor, q: Tensor, epsilon: float, max_confidence: float) -> Tensor:
    # KL(p || q) is infinite where q misses mass p has: a point-mass draft is never trusted unless p is one too.
    # Rounding can put two near-equal rows a hair below 0: clamped, epsilon = 0 is exactly "exact".
    trusted = (_kl(p, q).clamp_min(0.0) < epsilon) & (p.amax(-1) <= max_confidence)
    return torch.where(trusted.unsqueeze(-1), q, p)


# Each rule's math, by the name its RuleSpec has (a spec without math fails here, at import).
_MATH: dict[str, dict] = {
    "exact": {"target": _p},
    "lossy": {"target": _p, "relax": lambda p, lenience: 1.0 - lenience, "per_position": ("lenience",)},
    "lossy-entropy": {"target": _p, "relax": _gated_lenience},
    "static": {"target": _mixture, "correct_from_p": True},
    "dynamic": {"target": _mixture, "correct_from_p": True, "per_position": ("weight",)},
    "cascade-chow": {"target": _chow},
    "cascade-opt": {"target": _opt},
    "cascade-token": {"target": _token},
    "cactus": {"target": _p, "raise_draft": _cactus_mass},
    "judi": {"target": _judi},
    "typical": {},
}
RULES: dict[str, Rule] = {name: Rule(spec, **_MATH[name]) for name, spec in RULE_SPECS.items()}


_BLOCK = 512  # tokens per block of draw(); any size is exact, the size is only a matter of speed
_PROB_TOLERANCE = 1e-3  # float32 softmaxes over 150k tokens sum to 1 within ~1e-5; bf16 inputs are upcast


@dataclass(frozen=True)
class Verdict:
    """What a verifier decided for a batch of B drafted blocks of length N."""

    num_accepted: Tensor  # long [B], in 0..N: how many drafts are kept
    next_token: Tensor  # long [B]: the correction at the first rejection, or the bonus token
    accepted: Tensor  # bool [B, N]: the kept prefix, True for positions < num_accepted
    accept_prob: Tensor  # float [B, N]: probability each draft passes its own test (0 or 1 when deterministic)
    # float [B, N]: the uniform draw each draft's test compared with its accept_prob (0 for a greedy test, NaN for
    # typical's, which draws nothing): what another rule's test would have decided on the same draw.
    uniform: Tensor


def verify(
    rule: str,
    draft_tokens: Tensor,
    draft_probs: Tensor | None,
    target_probs: Tensor,
    *,
    weight: float | Tensor | None = None,
    lenience: float | Tensor | None = None,
    alpha: float | None = None,
    epsilon: float | None = None,
    delta: float | None = None,
    entropy_threshold: float | None = None,
    max_confidence: float | None = None,
    greedy: bool = False,
    generator: torch.Generator | None = None,
    validate: bool = True,
) -> Verdict:
    """Decide how many drafted tokens to keep and which token comes next, for a batch of blocks.

    Args:
        rule: one of RULES.
        draft_tokens: long [B, N], the drafted tokens (x_i ~ q_i, or argmax q_i in greedy mode).
        draft_probs: [B, N, V], q_i, already tempered / top-k / top-p filtered; None for drafts copied from text
            (point masses, as their one-hot rows would be: built only for a rule whose target reads q over the
            vocabulary; exact, lossy, lossy-entropy, cactus and typical never build them).
        target_probs: [B, N+1, V], p_i, processed the same way.
        weight: w, the weight on the target: a float in [0, 1] for "static", a [B, N] tensor for "dynamic".
        lenience: l in [0, 1) for "lossy" and "lossy-entropy"; for "lossy" also a [B, N] tensor, one l per
            sequence and position (a lenience head's, diversed.head.model.LenienceHead).
        alpha: the deferral parameter in [0, 1] of the cascade rules.
        epsilon, delta: thresholds of "typical" (defaults diversed.request.TYPICAL_EPSILON and TYPICAL_DELTA);
            epsilon is also "judi"'s KL(p || q) threshold and delta "cactus"'s KL budget, in nats, both >= 0
            (0 is exact).
        entropy_threshold: the entropy of p, in nats, from which "lossy-entropy" is lenient (default
            FLY_ENTROPY_THRESHOLD).
        max_confidence: "judi" trusts the draft only where max p is at most this (default JUDI_MAX_CONFIDENCE).
        greedy: accept iff the draft equals argmax pi_i; the correction is argmax pi_i, the bonus argmax p.
            ("lossy" and "lossy-entropy" verify against p, so greedy they are greedy exact; "cactus" against
            its raised target, so it keeps a draft its budget lifts to the top.)
        generator: the source of randomness in sampling mode, for reproducible runs.
        validate: check shapes, ranges and that the probabilities are distributions (a pass over them).

    Returns:
        A Verdict. No Python loop over the batch: every sequence is decided at once.
    """
    given = {"weight": weight, "lenience": lenience, "alpha": alpha, "epsilon": epsilon, "delta": delta,
             "entropy_threshold": entropy_threshold, "max_confidence": max_confidence}
    if validate:
        _check_inputs(rule, draft_tokens, draft_probs, target_probs, given)
    spec = RULES[rule]
    params = {**spec.defaults, **{k: v for k, v in given.items() if k in spec.parameters and v is not None}}
    p = target_probs.float()
    n = draft_tokens.shape[1]
    if rule == "typical":
        return _typical(draft_tokens, p, greedy, generator, **params)
    if draft_probs is not None:
        q = draft_probs.float()
    else:  # point masses: built only for a rule whose target reads q (exact's, lossy's and cactus's do not)
        q = None if spec.target is _p else point_masses(draft_tokens, p.shape[-1])

    pi = _target(spec, p[:, :n], q, draft_tokens, params)
    if greedy:
        target_choice = pi.argmax(-1)
        passed = draft_tokens == target_choice
        accept_prob = passed.float()
        uniform = torch.zeros_like(accept_prob)
    else:
        pi_x = pi.gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)
        q_x = torch.ones_like(pi_x) if q is None else q.gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)
        if spec.relax is not None:
            q_x = spec.relax(p[:, :n], **params) * q_x
        accept_prob = ratio_test(pi_x, q_x)
        uniform = torch.rand(accept_prob.shape, generator=generator, device=accept_prob.device)
        passed = uniform < accept_prob

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
        q_stopped = point_masses(draft_tokens[rows, stopped], p.shape[-1]) if q is None else q[rows, stopped]
        residual = _residual(corrected[rows, stopped], q_stopped)
        next_dist = torch.where(all_kept.unsqueeze(-1), p[:, n], residual)
        next_token = draw(next_dist, generator)
    return Verdict(num_accepted, next_token, accepted, accept_prob, uniform)


def exact_acceptance(draft_tokens: Tensor, draft_probs: Tensor | None, target_probs: Tensor, greedy: bool
                     ) -> Tensor:
    """The probability [B, N] that each draft passes exact's test: min(1, p(x) / q(x)) (q None: point masses,
    q(x) = 1), or in greedy mode 1 where x is argmax p and 0 elsewhere. Compared with a Verdict's
    `uniform`, it says whether exact would have kept a draft on the draw that decided it (uniform < it)."""
    n = draft_tokens.shape[1]
    p = target_probs[:, :n].float()
    if greedy:
        return (draft_tokens == p.argmax(-1)).float()
    index = draft_tokens.unsqueeze(-1)
    p_x = p.gather(-1, index).squeeze(-1)
    return ratio_test(p_x, torch.ones_like(p_x) if draft_probs is None else
                      draft_probs.float().gather(-1, index).squeeze(-1))


def point_masses(tokens: Tensor, vocab: int) -> Tensor:
    """The one-hot distributions [..., V] of drafts copied from text, tokens [...]."""
    return F.one_hot(tokens, vocab).float()


def _target(spec: Rule, p: Tensor, q: Tensor | None, draft: Tensor | None, params: dict) -> Tensor:
    """The rule's pi at each drafted position, p, q [..., V] (None only for a target that does not read it),
    draft long [...]."""
    pi = spec.target(p, q, **params)
    if spec.raise_draft is None:
        return pi
    index = draft.unsqueeze(-1)
    pi_x = pi.gather(-1, index)
    raised = spec.raise_draft(pi_x, **params)
    # The others keep their proportions: of all distributions giving x that mass, the closest to pi in every
    # f-divergence, KL included (Jensen). Where pi(x) = 1 there is nothing else to scale (0 / tiny = 0).
    rest = (1.0 - raised) / (1.0 - pi_x).clamp_min(torch.finfo(pi.dtype).tiny)
    return (pi * rest).scatter(-1, index, raised)


def ratio_test(pi_x: Tensor, q_x: Tensor) -> Tensor:
    """min(1, pi(x) / q(x)): the probability that a drafted x passes the shared test, q_x already relaxed
    where the rule relaxes it. q(x) = 0 cannot be drafted by sampling; if it is given anyway, it passes iff
    pi(x) > 0."""
    return (pi_x / q_x.clamp_min(torch.finfo(q_x.dtype).tiny)).clamp(max=1.0)


def total_variation(a: Tensor, b: Tensor) -> Tensor:
    """TV(a, b) = 0.5 * sum_x |a(x) - b(x)| over the last dimension."""
    return 0.5 * (a - b).abs().sum(-1)


def entropy(p: Tensor) -> Tensor:
    """H(p) = -sum_x p(x) log p(x), in nats, over the last dimension."""
    return torch.special.entr(p).sum(-1)


def _kl(a: Tensor, b: Tensor) -> Tensor:
    """KL(a || b) = sum_x a(x) log(a(x) / b(x)) over the last dimension: infinite where b misses mass a has."""
    return (torch.special.xlogy(a, a) - torch.special.xlogy(a, b)).sum(-1)


def _residual(pi: Tensor, q: Tensor) -> Tensor:
    """norm(max(0, pi - q)); pi itself where that is all zero (pi == q up to rounding: rejection had
    probability ~0, and pi is then the right distribution to fall back on)."""
    excess = (pi - q).clamp_min(0.0)
    mass = excess.sum(-1, keepdim=True)
    return torch.where(mass > 0, excess / mass.clamp_min(torch.finfo(mass.dtype).tiny), pi)


def _typical(draft_tokens: Tensor, p: Tensor, greedy: bool, generator: torch.Generator | None,
             epsilon: float, delta: float) -> Verdict:
    """Typical acceptance (Medusa): keep x_i iff p_i(x_i) > min(epsilon, delta * exp(-H(p_i)))."""
    n = draft_tokens.shape[1]
    p_draft = p[:, :n]
    h = entropy(p_draft)
    threshold = torch.minimum(torch.full_like(h, epsilon), delta * torch.exp(-h))
    passed = p_draft.gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1) > threshold
    accepted = passed.long().cumprod(-1).bool()
    num_accepted = accepted.sum(-1)
    next_dist = p[torch.arange(len(num_accepted), device=p.device), num_accepted]  # p_{j}, j = first reject
    if greedy:
        next_token = next_dist.argmax(-1)
    else:
        next_token = draw(next_dist, generator)
    return Verdict(num_accepted, next_token, accepted, passed.float(), torch.full_like(h, math.nan))


def _check_inputs(rule: str, draft_tokens: Tensor, draft_probs: Tensor | None, target_probs: Tensor,
                  params: dict) -> None:
    if draft_tokens.dim() != 2 or draft_tokens.dtype != torch.long:
        raise ValueError(f"draft_tokens must be a long tensor [B, N], got {draft_tokens.dtype} "
                         f"{tuple(draft_tokens.shape)}")
    b, n = draft_tokens.shape
    if n == 0:
        raise ValueError("draft_tokens has N = 0 drafted tokens: nothing to verify")
    if draft_probs is not None and (draft_probs.dim() != 3 or tuple(draft_probs.shape[:2]) != (b, n)):
        raise ValueError(f"draft_probs must be [B, N, V] = [{b}, {n}, V], got {tuple(draft_probs.shape)}")
    v = target_probs.shape[-1] if draft_probs is None else draft_probs.shape[2]
    if tuple(target_probs.shape) != (b, n + 1, v):
        raise ValueError(f"target_probs must be [B, N+1, V] = [{b}, {n + 1}, {v}] (same vocabulary as "
                         f"draft_probs), got {tuple(target_probs.shape)}")
    if draft_tokens.numel() and (draft_tokens.min() < 0 or draft_tokens.max() >= v):  # B = 0 is a valid batch
        raise ValueError(f"draft_tokens must be token ids in [0, {v}), got values in "
                         f"[{int(draft_tokens.min())}, {int(draft_tokens.max())}]")
    for name, probs in (("draft_probs", draft_probs), ("target_probs", target_probs)):
        if probs is None:
            continue
        probs = probs.float()
        if not torch.isfinite(probs).all():
            raise ValueError(f"{name} contains NaN or infinite values")
        if (probs < 0).any():
            raise ValueError(f"{name} contains negative probabilities")
        worst = (probs.sum(-1) - 1.0).abs().max() if probs.numel() else 0.0
        if worst > _PROB_TOLERANCE:
            raise ValueError(f"{name} rows must sum to 1 (within {_PROB_TOLERANCE}); one is off by {worst:.3g}")
    check_parameters(rule, **params, shape=(b, n))


def check_parameters(rule: str, *, weight: float | Tensor | None = None, lenience: float | Tensor | None = None,
                     alpha: float | None = None, epsilon: float | None = None, delta: float | None = None,
                     entropy_threshold: float | None = None, max_confidence: float | None = None,
                     shape: tuple[int, int] | None = None) -> None:
    """Raise ValueError unless the rule gets exactly its parameters, in range (diversed.request's check, and
    here a tensor's: one per drafted token, where the rule takes it so, Rule.per_position). `shape` (B, N) is
    the shape such a tensor must have (unchecked when None)."""
    given = {"weight": weight, "lenience": lenience, "alpha": alpha, "epsilon": epsilon, "delta": delta,
             "entropy_threshold": entropy_threshold, "max_confidence": max_confidence}
    for name, value in given.items():
        _check_per_position(rule, name, value, shape)
    # diversed.request checks numbers; a tensor is in range when its extremes are (NaN fails every range).
    for pick in (torch.amin, torch.amax):
        check_rule_parameters(rule, {k: _extreme(v, pick) if isinstance(v, Tensor) else v for k, v in given.items()})


def _check_per_position(rule: str, name: str, value: float | Tensor | None, shape: tuple[int, int] | None) -> None:
    """A tensor only for a parameter the rule takes per drafted token, of shape [B, N]; "dynamic"'s weight only
    so (a single weight is "static")."""
    if rule not in RULES or value is None or name not in RULES[rule].parameters:
        return  # an unknown rule, a missing or a foreign parameter: diversed.request says so
    per_position = name in RULES[rule].per_position
    if isinstance(value, Tensor) and not per_position and value.dim() != 0:
        takers = [other for other, spec in RULES.items() if name in spec.per_position]
        raise ValueError(f"{name} for {rule!r} must be a single number, got shape {tuple(value.shape)}"
                         + (f"; use rule {takers[0]!r} for one per position" if takers else ""))
    only_so = per_position and rule == "dynamic"
    wrong_shape = isinstance(value, Tensor) and shape is not None and tuple(value.shape) != shape
    if per_position and (wrong_shape or only_so and not isinstance(value, Tensor)):
        got = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
        raise ValueError(f"{name} for {rule!r} must be a tensor [B, N] = {list(shape or ())}, got {got}")


def _extreme(value: Tensor, pick: Callable[[Tensor], Tensor]) -> float:
    """The least or greatest of a tensor's values; 0.0 for an empty batch, which has none out of range (0 is in
    the range of both per-position parameters, weight and lenience)."""
    return float(pick(value.detach().float())) if value.numel() else 0.0


def draw(probs: Tensor, generator: torch.Generator | None) -> Tensor:
    """One token per row of probs [B, V] (unnormalised weights >= 0) -> [B], exactly distributed.

    In two stages: a block of _BLOCK tokens by the block's mass, then a token within it by its weight, so
    P(token) = P(block) P(token | block) = probs[token] / sum. Why: torch.multinomial over a whole vocabulary
    of 150k tokens is slow on a CPU next to two small draws (measured in
    benchmarks/results/notes/speed-transformers.md).
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

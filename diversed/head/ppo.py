"""The loss of one update of the head on stored rollouts (diversed.head.rollouts): a clipped policy-gradient
term for the task reward, and the acceptance term.

    loss            = pg_loss + acceptance_term
    pg_loss         = -(1/S) sum_sequences sum_{t not bonus} min(r_t A, clip(r_t, 1 - eps, 1 + eps) A)
    acceptance_term = -lambda (1/S) sum_sequences mean_{t not bonus} (1 - rejection_t / mean TV)
    A the sequence's advantage (its reward minus the leave-one-out baseline); S sequences.

r_t is the ratio of the probabilities, under the head being trained and the one that sampled, of what the head
decided at t. A mixture head decides the token's distribution: r_t = nu_t(y_t) / nu_old_t(y_t),
nu = w p + (1 - w) q, and rejection_t = w_t TV_t, the mixture's expected rejection. A lenience head decides
only whether the drafted x_t passes: it passes with a_t = min(1, p(x_t) / ((1 - L_t) q(x_t))), and the
draft and the correction (from norm(max(0, p - q))) do not depend on L. So r_t = a_t / a_old_t where x_t was
kept and (1 - a_t) / (1 - a_old_t) where it was rejected: REINFORCE on the verdicts, an unbiased policy
gradient as the one through the emitted tokens' marginal is, which needs no p and q over the vocabulary. Its
rejection_t = 1 - a_t, one draw x_t ~ q of the expected rejection sum_x q(x)(1 - a(x)), whose gradient it
estimates without bias; at L = 0 its mean is TV, exact's, as the mixture's is at w = 1.

The ratio is per token, with the sequence's advantage on each of its tokens (decision). The reward is per
sequence, and the exact importance weight of a sequence is the product of its tokens' ratios; over a hundred
tokens that product swings by orders of magnitude after a small change of the head, so a clip on it would
silence nearly every sequence after the first update, and unclipped its variance is what makes reusing
rollouts go wrong. Per token (as PPO for language models does) the surrogate has exactly the REINFORCE
gradient at the sampling head (r = 1: A sum_t grad log nu_t), each ratio stays near 1 where the head moved
little, and the clip bounds each token's contribution. The price: away from r = 1 it ignores how the changes
at earlier tokens reweight the later ones, a first-order error that the clip and a few epochs keep small.
Bonus tokens come from p, which does not depend on the head: their ratio is 1 and they carry no gradient;
no draft was verified there, so they have no acceptance either.
(The head also decides which positions become bonus tokens; like the paper, the estimator ignores that, a
small bias where bonus tokens are rare.)

The acceptance term is a function of the head's value on the stored inputs, differentiable directly: it needs
no ratio. It is measured in units of the step's mean TV(q, p) over its scored tokens (a constant of the
rollouts): mean_t (1 - rejection_t / mean TV) is 1 where nothing is rejected and about 0 at exact's rejection
for any pair, so lambda's scale does not
depend on how much the two models disagree (unnormalised, the default pair's TV of about 0.03 on code made
lambda = 30 the level where the acceptance term acted).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from diversed.head.model import FEATURES, EnsembleHead, LenienceHead
from diversed.head.rollouts import Rollouts
from diversed.verify import RULES, ratio_test


@dataclass
class Terms:
    """The two terms of the loss on a batch of rollouts, and how far the head has moved from the sampling one."""

    pg_loss: Tensor
    acceptance_term: Tensor
    clip_fraction: float  # share of the scored tokens whose ratio is outside [1 - clip, 1 + clip]
    approx_kl: float  # KL(nu_old || nu) per scored token, estimated on the sampled tokens: mean(r - 1 - log r)


def ppo_terms(head: EnsembleHead, batch: Rollouts, lam: float, clip: float) -> Terms:
    """Both terms of the loss of `head` on `batch` (see the module docstring), with gradients."""
    w = head(batch.h_draft.float(), batch.h_target.float(), batch.features)
    scored = ~batch.bonus
    # Bonus tokens come from p, which the head does not shape: ratio 1, no gradient.
    log_ratio = torch.where(scored, _log_decision(head, w, batch) - _log_decision(head, batch.old_w, batch), 0.0)
    ratio = log_ratio.exp()
    advantage = batch.advantage[batch.sequence]
    surrogate = torch.minimum(ratio * advantage, ratio.clamp(1 - clip, 1 + clip) * advantage)
    pg_loss = -torch.where(scored, surrogate, 0.0).sum() / len(batch.reward)
    # clamp: a step whose tokens all have TV = 0 has no acceptance to gain; its term is then 1 whatever w is.
    acceptance = batch.per_sequence_mean(1 - rejection(head, w, batch) / max(batch.mean_tv, 1e-12))
    with torch.no_grad():
        r, log_r = ratio[scored], log_ratio[scored]
        clip_fraction = ((r - 1).abs() > clip).float().mean().nan_to_num().item()  # nan_to_num: no scored token
        approx_kl = (r - 1 - log_r).mean().nan_to_num().item()
    return Terms(pg_loss, -lam * acceptance, clip_fraction, approx_kl)


def term_gradient_norms(head: EnsembleHead, batch: Rollouts, lam: float, clip: float) -> dict[str, float]:
    """The norm of each term's gradient over the whole batch: at the sampling head, how hard the reward and
    the acceptance pull (compare them to choose lambda)."""
    terms = ppo_terms(head, batch, lam, clip)
    params = list(head.parameters())
    norms = {}
    for name, term in (("pg_grad_norm", terms.pg_loss), ("acceptance_grad_norm", terms.acceptance_term)):
        grads = torch.autograd.grad(term, params, retain_graph=True)
        norms[name] = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])).item()
    return norms


def rejection(head: EnsembleHead, value: Tensor, batch: Rollouts) -> Tensor:
    """Each token's rejection probability [N] under the head's value (w, or L): the module docstring's
    rejection_t."""
    if isinstance(head, LenienceHead):
        return 1 - _lenient_pass(value, batch)
    return value * batch.tv


def _log_decision(head: EnsembleHead, value: Tensor, batch: Rollouts) -> Tensor:
    """log of the probability of what the head decided at each token, under its value (the module docstring)."""
    if not isinstance(head, LenienceHead):
        return _log_nu(value, batch)
    passed = _lenient_pass(value, batch)
    # The clamp keeps the log finite where a verdict became impossible (zero gradient there).
    return torch.log(torch.where(batch.kept, passed, 1 - passed).clamp_min(torch.finfo(torch.float32).tiny))


def _lenient_pass(lenience: Tensor, batch: Rollouts) -> Tensor:
    """a_t: the probability that rule "lossy" with lenience L_t keeps the drafted token (its relaxation reads
    no p)."""
    p_x, q_x = (batch.features[:, FEATURES.index(name)] for name in ("p(x)", "q(x)"))
    return ratio_test(p_x, RULES["lossy"].relax(None, lenience=lenience) * q_x)


def _log_nu(w: Tensor, batch: Rollouts) -> Tensor:
    # The clamp keeps the log finite where nu rounds to 0 in float32 (zero gradient there): a bonus token, drawn
    # from p, may be one the draft and the head give no weight; and rollouts of runs from before they were
    # traced hold teacher-forced rescores, not the values the tokens were sampled with.
    return torch.log((w * batch.p_y + (1 - w) * batch.q_y).clamp_min(torch.finfo(torch.float32).tiny))

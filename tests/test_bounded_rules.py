"""Tests for the training-free bounded rules of diversed.verify (docs/algorithm.md section 9): "cactus" (Hao & Mou),
"lossy-entropy" (lossy's lenience behind FLy's entropy gate) and "judi" (Sun et al.'s KL threshold).

As in test_verify: one vectorised verify call of 200,000 i.i.d. rounds per rule, every seed fixed, and each drafted
position's emitted token and acceptance compared with the rule's closed form, written out here in float64 apart
from the code under test. Each run's positions are chosen to exercise both branches of the rule and a point-mass
draft (a token copied from text: q = one-hot)."""

from __future__ import annotations

import math
from functools import cache

import pytest
import torch
from closed_forms import acceptance_probability, verification_target
from torch import Tensor

from diversed.request import FLY_ENTROPY_THRESHOLD, JUDI_MAX_CONFIDENCE, RULE_SPECS, VERIFICATIONS, Verification
from diversed.verify import (
    RULES,
    total_variation,
    verify,
)

from test_verify import (
    _assert_same_decisions,
    _mixed_batch,
    _same_seed,
    assert_distribution,
    assert_rate,
    emitted_at,
    lossy_output,
    one_hot,
    random_dist,
    run_rounds,
)

VOCAB = 20


# ---------------------------------------------------------------------------------------------------------
# The closed forms, from the rules' definitions (float64, one position: p, q [V])
# ---------------------------------------------------------------------------------------------------------


def entropy(p: Tensor) -> float:
    p = p.double()
    return float(-(p[p > 0] * p[p > 0].log()).sum())


def kl(a: Tensor, b: Tensor) -> float:
    a, b = a.double(), b.double()
    support = a > 0
    return float((a[support] * (a[support] / b[support]).log()).sum())


def cactus_target(p: Tensor, x: int, delta: float) -> Tensor:
    """h_x: p(x) raised to min(1, p(x) + sqrt(2 delta p(x)(1 - p(x)))), the other tokens scaled to fill the rest."""
    p = p.double()
    raised = min(1.0, float(p[x]) + math.sqrt(2 * delta * float(p[x]) * (1 - float(p[x]))))
    h = p * (1 - raised) / (1 - float(p[x])) if float(p[x]) < 1 else p.clone()
    h[x] = raised
    return h


def cactus_output(p: Tensor, q: Tensor, delta: float) -> Tensor:
    """Draft x ~ q; keep it with min(1, h_x(x) / q(x)); else draw from norm(max(0, h_x - q)). Summed over x."""
    p, q = p.double(), q.double()
    out = torch.zeros_like(p)
    for x in range(len(p)):
        h = cactus_target(p, x, delta)
        kept = min(float(q[x]), float(h[x]))
        out[x] += kept
        if float(q[x]) > kept:
            excess = (h - q).clamp_min(0)
            out += (float(q[x]) - kept) * excess / excess.sum()
    return out


def judi_target(p: Tensor, q: Tensor, epsilon: float, max_confidence: float = JUDI_MAX_CONFIDENCE) -> Tensor:
    """q where KL(p || q) < epsilon and max p <= max_confidence (the draft trusted), else p."""
    trusted = bool((q[p > 0] > 0).all()) and kl(p, q) < epsilon and float(p.max()) <= max_confidence
    return (q if trusted else p).double()


def gated_lossy_output(p: Tensor, q: Tensor, lenience: float, threshold: float = FLY_ENTROPY_THRESHOLD) -> Tensor:
    return lossy_output(p, q, lenience) if entropy(p) >= threshold else p.double()


def gated_lossy_acceptance(p: Tensor, q: Tensor, lenience: float, threshold: float = FLY_ENTROPY_THRESHOLD) -> float:
    scale = 1 - lenience if entropy(p) >= threshold else 1.0
    return float(torch.minimum(q.double(), p.double() / scale).sum())


def cactus_acceptance(p: Tensor, q: Tensor, delta: float) -> float:
    return sum(min(float(q[x]), float(cactus_target(p, x, delta)[x])) for x in range(len(p)))


# ---------------------------------------------------------------------------------------------------------
# One run per rule: N = 3 positions, each emitted token and each acceptance against the closed form
# ---------------------------------------------------------------------------------------------------------


def _copied(p: Tensor) -> Tensor:
    """A point-mass draft on the target's favourite (so that most rows go on past it)."""
    return one_hot(VOCAB, int(p.argmax()))


def _near(p: Tensor, seed: int, noise: float) -> Tensor:
    """p's logits perturbed: a draft that mostly agrees."""
    jitter = torch.randn(VOCAB, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return torch.softmax(p.double().log() + noise * jitter, -1).float()


# Each case: (rule, params, q [3, V], p [4, V] (the last is the bonus's), output(p_i, q_i), acceptance(p_i, q_i)),
# with a copied token at position 1.
def _cactus_case():
    # generic; a copy (raised below 1); a generic q under a peaked p (raised to 1 where p(x) >= 1/(1 + 2 delta))
    p = torch.stack([random_dist(204, VOCAB, 1.5), random_dist(224, VOCAB, 2.0), random_dist(216, VOCAB, 3.0),
                     random_dist(207, VOCAB, 1.0)])
    q = torch.stack([_near(p[0], 201, 1.0), _copied(p[1]), random_dist(203, VOCAB, 1.0)])
    return ("cactus", {"delta": 0.2}, q, p, lambda p_, q_: cactus_output(p_, q_, 0.2),
            lambda p_, q_: cactus_acceptance(p_, q_, 0.2))


def _lossy_entropy_case():
    # flat p (the gate open: lossy); a copy under a flat p (open); p sure of one token, H(p) = 0.29 (shut: exact)
    sure = torch.full((VOCAB,), 0.04 / (VOCAB - 1))
    sure[7] = 0.96
    p = torch.stack([random_dist(214, VOCAB, 1.0), random_dist(224, VOCAB, 1.5), sure, random_dist(217, VOCAB, 1.0)])
    q = torch.stack([_near(p[0], 211, 1.0), _copied(p[1]), random_dist(213, VOCAB, 1.0)])
    return ("lossy-entropy", {"lenience": 0.5}, q, p, lambda p_, q_: gated_lossy_output(p_, q_, 0.5),
            lambda p_, q_: gated_lossy_acceptance(p_, q_, 0.5))


def _judi_case():
    # q near p (trusted); a copy (KL(p || e_x) infinite: exact); q far from p (exact)
    p = torch.stack([random_dist(221, VOCAB, 1.5), random_dist(216, VOCAB, 2.0), random_dist(225, VOCAB, 1.0),
                     random_dist(226, VOCAB, 1.0)])
    q = torch.stack([_near(p[0], 222, 0.3), _copied(p[1]), random_dist(223, VOCAB, 2.0)])
    return ("judi", {"epsilon": 0.1}, q, p, lambda p_, q_: judi_target(p_, q_, 0.1),
            lambda p_, q_: float(torch.minimum(q_.double(), judi_target(p_, q_, 0.1)).sum()))


CASES = {"cactus": _cactus_case, "lossy-entropy": _lossy_entropy_case, "judi": _judi_case}


@cache
def _run(name: str):
    rule, params, q, p, output, acceptance = CASES[name]()
    drafts, result = run_rounds(rule, q, p, seed=300 + list(CASES).index(name), **params)
    return rule, params, q, p, output, acceptance, drafts, result


def test_cases_exercise_both_branches_of_each_rule():
    """The runs below only test a gate if it opens at one position and shuts at another."""
    _, _, q, p, *_ = _run("lossy-entropy")
    assert [entropy(p[i]) >= FLY_ENTROPY_THRESHOLD for i in range(3)] == [True, True, False]
    _, _, q, p, *_ = _run("judi")
    assert [torch.equal(judi_target(p[i], q[i], 0.1), q[i].double()) for i in range(3)] == [True, False, False]
    _, _, q, p, *_ = _run("cactus")
    raised = [float(cactus_target(p[i], x, 0.2)[x]) for i in range(3) for x in range(VOCAB)]
    assert 1.0 in raised and min(raised) < 1.0  # the raise is clipped at 1 somewhere, and not everywhere


@pytest.mark.parametrize("name", CASES)
def test_each_position_emits_the_rules_output_distribution(name):
    """Conditional on the earlier drafts kept, the token emitted at position i (the draft or the correction)
    follows the closed form; with a point-mass q it is exactly what the rule's definition gives for x."""
    rule, params, q, p, output, _, drafts, result = _run(name)
    for i in range(3):
        reached, tokens = emitted_at(drafts, result, i)
        assert reached.sum() >= 100_000, f"{name}: too few rows reach position {i}"
        assert_distribution(tokens, output(p[i], q[i]), f"{name}: emitted token at position {i}")


@pytest.mark.parametrize("name", CASES)
def test_acceptance_matches_closed_form(name):
    rule, params, q, p, _, acceptance, drafts, result = _run(name)
    for i in range(3):
        closed_form = float(acceptance_probability(rule, p[i], q[i], **params))
        assert closed_form == pytest.approx(acceptance(p[i], q[i]), abs=1e-5), f"position {i}"
        reached = result.num_accepted >= i
        assert_rate((result.num_accepted > i)[reached], closed_form, f"{name}: acceptance at position {i}")


def test_point_mass_draft_closed_forms():
    """q = e_x: cactus emits its target h_x itself; judi is exact (KL(p || e_x) is infinite); lossy-entropy
    accepts a copy with min(1, p(x) / (1 - l)) where the target is uncertain."""
    p, x = random_dist(231, VOCAB, 1.0), 6
    e_x = one_hot(VOCAB, x)
    h = cactus_target(p, x, 0.3)
    assert torch.allclose(cactus_output(p, e_x, 0.3), h, atol=1e-12)
    assert torch.allclose(verification_target("cactus", p, e_x, draft=torch.tensor(x), delta=0.3).double(), h,
                          atol=1e-6)
    assert float(acceptance_probability("cactus", p, e_x, delta=0.3)) == pytest.approx(float(h[x]), abs=1e-6)
    assert torch.equal(verification_target("judi", p, e_x, epsilon=1e6, max_confidence=1.0), p)
    assert float(acceptance_probability("lossy-entropy", p, e_x, lenience=0.5)) == pytest.approx(
        min(1.0, 2 * float(p[x])), abs=1e-6)


# ---------------------------------------------------------------------------------------------------------
# The bounds of docs/algorithm.md section 9, on the closed forms
# ---------------------------------------------------------------------------------------------------------

def _exact_dist(seed: int, scale: float) -> Tensor:
    """random_dist renormalised in float64, so that identities hold to 1e-9."""
    probs = random_dist(seed, 12, scale).double()
    return probs / probs.sum()


PAIRS = [(_exact_dist(s, sp), _exact_dist(s + 40, sq))
         for s, (sp, sq) in enumerate([(0.5, 3.0), (3.0, 0.5), (1.5, 1.5), (4.0, 4.0), (0.3, 1.0)], start=240)]


@pytest.mark.parametrize("delta", [0.01, 0.2, 1.0])
def test_cactus_targets_are_within_their_budget_and_its_output_on_the_pareto_front(delta):
    """Each h_x is within KL log(1 + 2 delta) of p (its chi^2 is at most 2 delta); the output spends exactly its
    extra acceptance as bias, TV(mu, p) = acceptance - exact's: rejection + bias = TV(q, p)."""
    for p, q in PAIRS:
        for x in range(len(p)):
            assert kl(cactus_target(p, x, delta), p) <= math.log(1 + 2 * delta) + 1e-9
        bias = float(total_variation(cactus_output(p, q, delta), p.double()))
        rejection = 1 - cactus_acceptance(p, q, delta)
        assert rejection + bias == pytest.approx(float(total_variation(q.double(), p.double())), abs=1e-9)


def test_cactus_budget_is_per_draft_not_on_its_output():
    """p uniform over 8 tokens, q over the first 4: every h_x is within delta of p, but each draft raises its own
    token, and the output drifts by several times delta."""
    p, q = torch.full((8,), 1 / 8), torch.cat([torch.full((4,), 1 / 4), torch.zeros(4)])
    assert max(kl(cactus_target(p, x, 0.01), p) for x in range(4)) < 0.01
    assert kl(cactus_output(p, q, 0.01), p) > 0.07


@pytest.mark.parametrize("lenience", [0.3, 0.9])
def test_lossy_outputs_overshoot_p_by_at_most_one_over_one_minus_lenience(lenience):
    """lossy's output is within p / (1 - l) of p everywhere (lossy-entropy's where its gate opens, and p itself
    where it shuts), and on the same Pareto front as cactus."""
    for p, q in PAIRS:
        out = lossy_output(p, q, lenience)
        assert bool((out <= p.double() / (1 - lenience) + 1e-12).all())
        rejection = 1 - float(torch.minimum(q.double(), p.double() / (1 - lenience)).sum())
        bias = float(total_variation(out, p.double()))
        assert rejection + bias == pytest.approx(float(total_variation(q.double(), p.double())), abs=1e-9)


def test_judi_bias_is_within_pinsker_of_its_threshold():
    """Where judi trusts the draft, KL(p || q) < eps, so its bias TV(q, p) <= sqrt(eps / 2)."""
    for epsilon in (0.05, 0.5):
        for p, q in PAIRS:
            bias = float(total_variation(judi_target(p, q, epsilon, 1.0), p.double()))
            assert bias <= math.sqrt(epsilon / 2)


# ---------------------------------------------------------------------------------------------------------
# Strict ends: exact under the same seed; lenient ends where they are defined
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("rule", "params"), [
    ("cactus", {"delta": 0.0}), ("judi", {"epsilon": 0.0}), ("judi", {"epsilon": 0.5, "max_confidence": 0.0}),
    ("lossy-entropy", {"lenience": 0.0}), ("lossy-entropy", {"lenience": 0.6, "entropy_threshold": 50.0}),
], ids=["cactus-d0", "judi-eps0", "judi-c0", "lossy-entropy-l0", "lossy-entropy-gate-shut"])
def test_strict_end_equals_exact_under_same_seed(rule, params):
    drafts, q, p = _mixed_batch()
    _assert_same_decisions(_same_seed(rule, drafts, q, p, **params), _exact_on_mixed_batch(), f"{rule} {params}")


@cache
def _exact_on_mixed_batch():
    return _same_seed("exact", *_mixed_batch())


def test_lossy_entropy_with_the_gate_always_open_equals_lossy_under_same_seed():
    drafts, q, p = _mixed_batch()
    _assert_same_decisions(_same_seed("lossy-entropy", drafts, q, p, lenience=0.6, entropy_threshold=0.0),
                           _same_seed("lossy", drafts, q, p, lenience=0.6), "lossy-entropy gate open vs lossy")


def test_lenient_ends_keep_every_draft_they_can():
    """cactus raises p(x) to 1, a certain acceptance, once p(x) >= 1 / (1 + 2 delta); judi trusting every KL
    trusts every q that covers p (a finite KL(p || q)). Rows of _mixed_batch have float32 zeros and tiny
    probabilities, so neither keeps everything."""
    drafts, q, p = _mixed_batch()
    n, delta = drafts.shape[1], 1e3
    p_x = p[:, :n].gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
    cactus = _same_seed("cactus", drafts, q, p, delta=delta).accept_prob
    assert bool((cactus[p_x >= 1.01 / (1 + 2 * delta)] == 1).all()) and bool((cactus < 1).any())
    covered = ((q > 0) | (p[:, :n] == 0)).all(-1)
    judi = _same_seed("judi", drafts, q, p, epsilon=1e6, max_confidence=1.0).accept_prob
    assert bool((judi[covered] == 1).all()) and not covered.all()


# ---------------------------------------------------------------------------------------------------------
# Greedy mode and batches
# ---------------------------------------------------------------------------------------------------------


def _greedy_inputs(batch: int = 48, n: int = 3, seed: int = 260):
    """Drafts argmax q; p from peaked to flat, agreeing with the draft on about half the positions; and a
    few point-mass drafts."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.exp(torch.randn(batch, 1, 1, generator=g))
    q = torch.softmax(torch.randn(batch, n, VOCAB, generator=g) * 2, -1)
    q[::5, 0] = one_hot(VOCAB, 3)
    drafts = q.argmax(-1)
    logits = torch.randn(batch, n + 1, VOCAB, generator=g) * scale
    agree = torch.rand(batch, n, generator=g) < 0.5
    logits[:, :n].scatter_add_(-1, drafts.unsqueeze(-1), 3.0 * agree.unsqueeze(-1).float())
    return drafts, q, torch.softmax(logits, -1)


def _reference_greedy(drafts, q, p, target):
    """Keep x_i while it is argmax pi_i; the correction is argmax pi_i at the first miss, the bonus argmax p."""
    num, nxt = [], []
    for b in range(len(drafts)):
        k = next((i for i in range(drafts.shape[1])
                  if int(drafts[b, i]) != int(target(p[b, i], q[b, i], int(drafts[b, i])).argmax())), None)
        num.append(drafts.shape[1] if k is None else k)
        nxt.append(int(p[b, -1].argmax()) if k is None else int(target(p[b, k], q[b, k], int(drafts[b, k])).argmax()))
    return torch.tensor(num), torch.tensor(nxt)


@pytest.mark.parametrize(("rule", "params", "target"), [
    ("cactus", {"delta": 0.3}, lambda p, q, x: cactus_target(p, x, 0.3)),
    ("judi", {"epsilon": 0.8}, lambda p, q, x: judi_target(p, q, 0.8)),
    ("lossy-entropy", {"lenience": 0.9}, lambda p, q, x: p),
], ids=["cactus", "judi", "lossy-entropy"])
def test_greedy_keeps_drafts_that_are_the_argmax_of_their_target(rule, params, target):
    drafts, q, p = _greedy_inputs()
    result = verify(rule, drafts, q, p, greedy=True, **params)
    num, nxt = _reference_greedy(drafts, q, p, target)
    assert torch.equal(result.num_accepted, num) and torch.equal(result.next_token, nxt)
    exact = verify("exact", drafts, q, p, greedy=True)
    if rule == "lossy-entropy":  # it verifies against p: greedy, it is greedy exact
        assert torch.equal(result.num_accepted, exact.num_accepted)
    else:  # the comparison says something: the rule kept drafts that exact refused
        assert bool((result.num_accepted >= exact.num_accepted).all())
        assert bool((result.num_accepted > exact.num_accepted).any())
    for b in range(0, len(drafts), 7):  # batched rows are decided as they are alone
        single = verify(rule, drafts[b:b + 1], q[b:b + 1], p[b:b + 1], greedy=True, **params)
        assert int(single.num_accepted) == int(result.num_accepted[b]) and int(single.next_token) == int(nxt[b])


def test_cactus_target_is_batched_per_draft():
    """verification_target over [B, N, V] with a draft per position equals h_x one position at a time."""
    drafts, q, p = _greedy_inputs(batch=6)
    pi = verification_target("cactus", p[:, :3], q, draft=drafts, delta=0.4)
    for b in range(6):
        for i in range(3):
            assert torch.allclose(pi[b, i].double(), cactus_target(p[b, i], int(drafts[b, i]), 0.4), atol=1e-6)
    assert torch.allclose(pi.sum(-1), torch.ones(6, 3), atol=1e-5)
    with pytest.raises(ValueError, match="draft"):
        verification_target("cactus", p[:, :3], q, delta=0.4)


# ---------------------------------------------------------------------------------------------------------
# Parameters: validation, defaults, the "name:value" syntax
# ---------------------------------------------------------------------------------------------------------

BAD_PARAMETERS = {
    "cactus delta negative": ("cactus", {"delta": -0.1}, "delta must be non-negative"),
    "cactus delta NaN": ("cactus", {"delta": float("nan")}, "delta"),
    "cactus delta inf": ("cactus", {"delta": float("inf")}, "delta"),
    "cactus without delta": ("cactus", {}, "needs delta"),
    "lenience given to cactus": ("cactus", {"delta": 0.1, "lenience": 0.1}, "lenience.*cactus"),
    "judi epsilon negative": ("judi", {"epsilon": -1.0}, "epsilon must be non-negative"),
    "judi max_confidence above 1": ("judi", {"epsilon": 0.1, "max_confidence": 1.5}, r"max_confidence.*\[0, 1\]"),
    "judi max_confidence NaN": ("judi", {"epsilon": 0.1, "max_confidence": float("nan")}, "max_confidence"),
    "judi without epsilon": ("judi", {"max_confidence": 0.5}, "needs epsilon"),
    "max_confidence given to exact": ("exact", {"max_confidence": 0.5}, "max_confidence.*exact"),
    "lossy-entropy lenience 1": ("lossy-entropy", {"lenience": 1.0}, r"lenience.*\[0, 1\)"),
    "lossy-entropy threshold negative": ("lossy-entropy", {"lenience": 0.5, "entropy_threshold": -0.1},
                                         "entropy_threshold"),
    "lossy-entropy threshold NaN": ("lossy-entropy", {"lenience": 0.5, "entropy_threshold": float("nan")},
                                    "entropy_threshold"),
    "lossy-entropy without lenience": ("lossy-entropy", {}, "needs lenience"),
    "entropy_threshold given to lossy": ("lossy", {"lenience": 0.5, "entropy_threshold": 1.0},
                                         "entropy_threshold.*lossy"),
    # typical's ranges are its own: the 0 cactus and judi take is still refused there
    "typical delta 0": ("typical", {"delta": 0.0}, "delta must be positive"),
    "typical epsilon 0": ("typical", {"epsilon": 0.0}, "epsilon must be positive"),
}


def _small_inputs():
    g = torch.Generator().manual_seed(270)
    q = torch.softmax(torch.randn(3, 2, 8, generator=g), -1)
    p = torch.softmax(torch.randn(3, 3, 8, generator=g), -1)
    return torch.randint(8, (3, 2), generator=g), q, p


@pytest.mark.parametrize("name", BAD_PARAMETERS)
def test_bad_parameter_raises_value_error_naming_it(name):
    rule, params, match = BAD_PARAMETERS[name]
    drafts, q, p = _small_inputs()
    for greedy in (False, True):
        with pytest.raises(ValueError, match=match):
            verify(rule, drafts, q, p, greedy=greedy, generator=torch.Generator().manual_seed(0), **params)


def test_defaults_are_the_papers_and_may_be_given():
    drafts, q, p = _small_inputs()
    for rule, first, second, default in (("lossy-entropy", {"lenience": 0.5}, "entropy_threshold",
                                          FLY_ENTROPY_THRESHOLD), ("judi", {"epsilon": 0.3}, "max_confidence",
                                                                   JUDI_MAX_CONFIDENCE)):
        assert RULE_SPECS[rule].defaults == {second: default} and not RULE_SPECS[rule].optional
        implicit = _same_seed(rule, drafts, q, p, **first)
        explicit = _same_seed(rule, drafts, q, p, **first, **{second: default})
        assert torch.equal(implicit.num_accepted, explicit.num_accepted)
        assert torch.equal(implicit.next_token, explicit.next_token)


@pytest.mark.parametrize(("text", "params"), [("cactus:0.5", {"delta": 0.5}), ("judi:0.3", {"epsilon": 0.3}),
                                              ("lossy-entropy:0.7", {"lenience": 0.7})])
def test_verification_syntax_sets_the_first_parameter(text, params):
    verification = Verification.parse(text)
    assert verification.rule == text.partition(":")[0] and verification.verify_params() == params
    assert verification.label == text
    drafts, q, p = _small_inputs()
    verify(verification.rule, drafts, q, p, generator=torch.Generator().manual_seed(0), **verification.verify_params())


@pytest.mark.parametrize(("text", "match"), [("cactus:-1", "delta"), ("judi:nan", "epsilon"),
                                             ("lossy-entropy:1", "lenience"), ("cactus", "needs delta")])
def test_verification_syntax_refuses_bad_values(text, match):
    with pytest.raises(ValueError, match=match):
        Verification.parse(text)


@pytest.mark.parametrize(("text", "params"), [
    ("lossy-entropy:0.5,entropy_threshold=1.2", {"lenience": 0.5, "entropy_threshold": 1.2}),
    ("judi:0.1,max_confidence=0.8", {"epsilon": 0.1, "max_confidence": 0.8}),
    ("typical:0.05,delta=0.5", {"epsilon": 0.05, "delta": 0.5})])
def test_every_parameter_of_a_rule_can_be_set_by_name(text, params):
    verification = Verification.parse(text)
    assert verification.verify_params() == params and verification.label == text
    assert Verification.parse(verification.label) == verification
    drafts, q, p = _small_inputs()
    verify(verification.rule, drafts, q, p, generator=torch.Generator().manual_seed(0), **verification.verify_params())


@pytest.mark.parametrize(("text", "match"), [("judi:0.1,max_confidence=2", "max_confidence must be in"),
                                             ("judi:0.1,delta=0.3", "not one of its other parameters"),
                                             ("lossy:0.1,lenience=0.2", "it has none"),
                                             ("lossy-entropy:0.5,entropy_threshold", "NAME=VALUE"),
                                             ("typical:0.05,delta=x", "cannot read verification")])
def test_a_named_parameter_that_does_not_fit_is_refused(text, match):
    with pytest.raises(ValueError, match=match):
        Verification.parse(text)


def test_rule_names_do_not_clash():
    assert len(set(VERIFICATIONS)) == len(VERIFICATIONS)
    assert {"cactus", "judi", "lossy-entropy"} <= set(RULES) and not {"cactus", "judi", "lossy-entropy"} & {
        "plain", "diversed"}

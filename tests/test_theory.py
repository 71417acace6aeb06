"""Tests for the closed forms (tests/closed_forms.py) of docs/algorithm.md section 2.6, checked against direct
computation and against simulation with diversed.verify (fixed seeds, so deterministic)."""

from __future__ import annotations

import math

import closed_forms as theory
import pytest
import torch
from closed_forms import acceptance_probability, expected_tokens_per_round, verification_target
from torch import Tensor

from diversed.verify import verify

SIGMAS = 5.0


def random_dist(seed: int, vocab: int, scale: float) -> Tensor:
    """softmax(randn * scale) in float32: large scale = peaked, small = flat."""
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(vocab, generator=g, dtype=torch.float64) * scale, -1).float()


PAIRS = {  # name: (p, q)
    "peaked-p-flat-q": (random_dist(1, 20, 4.0), random_dist(2, 20, 0.5)),
    "flat-p-peaked-q": (random_dist(3, 20, 0.5), random_dist(4, 20, 4.0)),
    "moderate": (random_dist(5, 20, 1.5), random_dist(6, 20, 1.5)),
    "similar": (random_dist(7, 20, 1.0), random_dist(7, 20, 1.0) * 0.8 + random_dist(8, 20, 1.0) * 0.2),
}


def tv64(a: Tensor, b: Tensor) -> float:
    return 0.5 * float((a.double() - b.double()).abs().sum())


def simulate(rule: str, q: Tensor, p: Tensor, *, batch: int, seed: int, **params):
    """`batch` rounds in one verify call; q [N, V] (drafts x_i ~ q_i), p [N+1, V]."""
    g = torch.Generator().manual_seed(seed)
    drafts = torch.multinomial(q, batch, replacement=True, generator=g).T.contiguous()
    n, v = q.shape
    # validation is covered in test_verify; on 100k+ expanded rows it costs as much as the sampling
    result = verify(rule, drafts, q.expand(batch, n, v), p.expand(batch, n + 1, v), generator=g,
                    validate=False, **params)
    return drafts, result


# ---------------------------------------------------------------------------------------------------------
# acceptance_probability
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("pair", PAIRS)
def test_acceptance_probability_exact_is_one_minus_tv(pair):
    p, q = PAIRS[pair]
    a = float(acceptance_probability("exact", p, q))
    assert a == pytest.approx(1 - tv64(q, p), abs=1e-6)
    assert a == pytest.approx(float(torch.minimum(p.double(), q.double()).sum()), abs=1e-6)


@pytest.mark.parametrize("pair", PAIRS)
@pytest.mark.parametrize("w", [0.0, 0.25, 0.6, 1.0])
def test_acceptance_probability_static_is_one_minus_w_tv(pair, w):
    p, q = PAIRS[pair]
    expected = 1 - w * tv64(q, p)
    assert float(acceptance_probability("static", p, q, weight=w)) == pytest.approx(expected, abs=1e-6)
    assert float(theory.ensemble_acceptance(p, q, w)) == pytest.approx(expected, abs=1e-6)
    nu = w * p.double() + (1 - w) * q.double()
    assert expected == pytest.approx(1 - tv64(q, nu), abs=1e-6)  # = sum_x q min(1, nu/q)


def test_acceptance_probability_dynamic_uses_each_positions_weight():
    p = torch.stack([PAIRS["moderate"][0], PAIRS["similar"][0]])
    q = torch.stack([PAIRS["moderate"][1], PAIRS["similar"][1]])
    w = torch.tensor([0.3, 0.9])
    got = acceptance_probability("dynamic", p, q, weight=w)
    expected = [1 - float(w[i]) * tv64(q[i], p[i]) for i in range(2)]
    assert got.tolist() == pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize("pair", PAIRS)
def test_acceptance_probability_lossy(pair):
    p, q = PAIRS[pair]
    values = []
    for lenience in (0.0, 0.2, 0.5, 0.9):
        direct = float((q.double() * torch.clamp(p.double() / ((1 - lenience) * q.double()), max=1.0)).sum())
        got = float(acceptance_probability("lossy", p, q, lenience=lenience))
        assert got == pytest.approx(direct, abs=1e-6), f"lenience {lenience}"
        values.append(got)
    assert values[0] == pytest.approx(float(acceptance_probability("exact", p, q)), abs=1e-6)
    assert values == sorted(values), "acceptance must not fall as lenience rises"


def test_acceptance_probability_has_no_closed_form_for_typical():
    p, q = PAIRS["moderate"]
    with pytest.raises(ValueError, match="typical"):
        acceptance_probability("typical", p, q)


# ---------------------------------------------------------------------------------------------------------
# ensemble_bias, pareto_front
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("pair", PAIRS)
@pytest.mark.parametrize("w", [0.0, 0.3, 0.75, 1.0])
def test_ensemble_bias_equals_tv_of_mixture_to_target(pair, w):
    p, q = PAIRS[pair]
    nu = w * p.double() + (1 - w) * q.double()
    assert float(theory.ensemble_bias(p, q, w)) == pytest.approx(tv64(nu, p), abs=1e-6)
    assert float(theory.ensemble_bias(p, q, w)) == pytest.approx((1 - w) * tv64(q, p), abs=1e-6)


def test_ensemble_bias_and_acceptance_broadcast_over_a_batch():
    p = torch.stack([PAIRS[k][0] for k in ("moderate", "similar")])
    q = torch.stack([PAIRS[k][1] for k in ("moderate", "similar")])
    w = torch.tensor([0.2, 0.7])
    bias, acc = theory.ensemble_bias(p, q, w), theory.ensemble_acceptance(p, q, w)
    for i in range(2):
        nu = w[i].double() * p[i].double() + (1 - w[i].double()) * q[i].double()
        assert float(bias[i]) == pytest.approx(tv64(nu, p[i]), abs=1e-6)
        assert float(acc[i]) == pytest.approx(1 - tv64(q[i], nu), abs=1e-6)


@pytest.mark.parametrize("pair", PAIRS)
def test_pareto_front_points_lie_on_rejection_plus_bias_equals_tv(pair):
    p, q = PAIRS[pair]
    weights = torch.linspace(0, 1, 11)
    rejection, bias = theory.pareto_front(p, q, weights)
    tv = tv64(q, p)
    assert rejection.shape == bias.shape == weights.shape
    assert (rejection + bias).double().tolist() == pytest.approx([tv] * 11, abs=1e-6)
    acceptance = theory.ensemble_acceptance(p, q, weights)
    assert rejection.tolist() == pytest.approx((1 - acceptance).tolist(), abs=1e-6)
    assert bias.tolist() == pytest.approx(theory.ensemble_bias(p, q, weights).tolist(), abs=1e-6)
    assert (float(rejection[0]), float(bias[0])) == pytest.approx((0.0, tv), abs=1e-6)  # w = 0: accept all
    assert (float(rejection[-1]), float(bias[-1])) == pytest.approx((tv, 0.0), abs=1e-6)  # w = 1: exact
    assert bool((rejection.diff() > 0).all()) and bool((bias.diff() < 0).all())


@pytest.mark.parametrize("pair", PAIRS)
@pytest.mark.parametrize(("rule", "params"), [
    ("cascade-chow", {"alpha": 0.8}), ("cascade-opt", {"alpha": 0.3}), ("cascade-token", {"alpha": 0.5}),
    ("lossy", {"lenience": 0.4}),
])
def test_other_rules_do_not_cross_the_pareto_front(pair, rule, params):
    """Proposition 1: any verifier with x ~ q has rejection + bias >= TV(q, p). On the closed forms: test_verify
    checks that verify()'s samples follow them (acceptance rate and first token's distribution, per rule)."""
    p, q = PAIRS[pair]
    rejection = 1 - float(acceptance_probability(rule, p, q, **params))
    if rule == "lossy":
        kept = torch.minimum(q.double(), p.double() / (1 - params["lenience"]))
        residual = (p.double() - q.double()).clamp_min(0)
        output = kept + (1 - kept.sum()) * residual / residual.sum()
    else:
        output = verification_target(rule, p, q, **params)
    assert rejection + tv64(output, p) >= tv64(q, p) - 1e-6


# ---------------------------------------------------------------------------------------------------------
# expected_tokens_per_round and expected_speedup
# ---------------------------------------------------------------------------------------------------------


def test_expected_tokens_per_round_closed_forms():
    assert expected_tokens_per_round([]) == 1.0
    assert expected_tokens_per_round([1.0] * 5) == pytest.approx(6.0)
    assert expected_tokens_per_round([0.0, 1.0, 1.0]) == pytest.approx(1.0)
    assert expected_tokens_per_round([0.5, 0.2]) == pytest.approx(1 + 0.5 + 0.1)
    assert expected_tokens_per_round(torch.tensor([0.5, 0.2])) == pytest.approx(1.6)
    for a in (0.1, 0.6, 0.9):
        for n in (1, 4, 7):
            assert expected_tokens_per_round([a] * n) == pytest.approx((1 - a ** (n + 1)) / (1 - a))


SIMULATIONS = [(3, "exact", {}, "similar"), (4, "static", {"weight": 0.5}, "moderate"),
               (5, "lossy", {"lenience": 0.3}, "moderate"), (4, "cascade-token", {"alpha": 0.5}, "similar")]


@pytest.mark.parametrize(("n", "rule", "params", "pair"), SIMULATIONS,
                         ids=[f"{r}-N{n}" for n, r, _, _ in SIMULATIONS])
def test_expected_tokens_per_round_matches_simulation(n, rule, params, pair):
    """The engine emits num_accepted + 1 tokens per round; with i.i.d. positions (the same p, q at every
    drafted position) its mean is 1 + sum_k a^k."""
    p1, q1 = PAIRS[pair]
    q = q1.expand(n, -1)
    p = torch.cat([p1.expand(n, -1), random_dist(20, p1.numel(), 1.0).unsqueeze(0)])
    a = float(acceptance_probability(rule, p1, q1, **params))
    assert 0.3 < a < 0.95, "acceptance should be far from 0 and 1 for a meaningful check"
    _, result = simulate(rule, q, p, batch=100_000, seed=300 + n, **params)
    tokens = (1 + result.num_accepted).double()
    expected = expected_tokens_per_round([a] * n)
    bound = SIGMAS * float(tokens.std()) / math.sqrt(tokens.numel()) + 1e-4
    assert abs(float(tokens.mean()) - expected) < bound, f"{float(tokens.mean()):.4f} vs {expected:.4f}"


def test_expected_tokens_per_round_matches_simulation_with_position_dependent_acceptance():
    n, vocab = 4, 20
    g = torch.Generator().manual_seed(400)
    logits = torch.randn(n + 1, vocab, generator=g) * 1.5
    p = torch.softmax(logits, -1)
    noise = torch.linspace(0.3, 2.0, n).unsqueeze(1) * torch.randn(n, vocab, generator=g)
    q = torch.softmax(logits[:n] + noise, -1)
    accept = [float(acceptance_probability("exact", p[i], q[i])) for i in range(n)]
    assert max(accept) - min(accept) > 0.1, "positions should differ"
    _, result = simulate("exact", q, p, batch=100_000, seed=401)
    tokens = (1 + result.num_accepted).double()
    expected = expected_tokens_per_round(accept)
    bound = SIGMAS * float(tokens.std()) / math.sqrt(tokens.numel()) + 1e-4
    assert abs(float(tokens.mean()) - expected) < bound, f"{float(tokens.mean()):.4f} vs {expected:.4f}"


@pytest.mark.parametrize("a", [0.0, 0.3, 0.7, 0.95, 1.0])
@pytest.mark.parametrize("n", [1, 3, 5, 8])
@pytest.mark.parametrize("c", [0.0, 0.05, 0.3])
def test_expected_speedup_with_unit_verify_cost_is_leviathans_formula(a, n, c):
    leviathan = (n + 1) / (n * c + 1) if a == 1.0 else (1 - a ** (n + 1)) / ((1 - a) * (n * c + 1))
    assert theory.expected_speedup(a, n, c) == pytest.approx(leviathan, rel=1e-9)
    assert theory.expected_speedup(a, n, c, verify_cost=1.0) == pytest.approx(leviathan, rel=1e-9)


@pytest.mark.parametrize("verify_cost", [1.2, 2.0, 5.0])
def test_verify_cost_above_one_lowers_expected_speedup(verify_cost):
    a, n, c = 0.7, 4, 0.1
    slower = theory.expected_speedup(a, n, c, verify_cost=verify_cost)
    assert slower < theory.expected_speedup(a, n, c)
    assert slower == pytest.approx(expected_tokens_per_round([a] * n) / (n * c + verify_cost))


# ---------------------------------------------------------------------------------------------------------
# The static ensemble's bias, measured
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("w", [0.25, 0.75])
def test_empirical_bias_of_static_ensemble_matches_ensemble_bias(w):
    p1, q1 = PAIRS["peaked-p-flat-q"]
    p = torch.stack([p1, random_dist(21, p1.numel(), 1.0)])
    drafts, result = simulate("static", q1.unsqueeze(0), p, batch=200_000, seed=500, weight=w)
    first = torch.where(result.num_accepted > 0, drafts[:, 0], result.next_token)
    empirical = torch.bincount(first, minlength=p1.numel()).double() / first.numel()
    measured = tv64(empirical, p1)
    assert measured == pytest.approx(float(theory.ensemble_bias(p1, q1, w)), abs=0.01)
    rejection = 1 - float((result.num_accepted > 0).double().mean())
    assert rejection + measured == pytest.approx(tv64(q1, p1), abs=0.015)  # on the front, up to sampling

"""Tests for diversed.verify: every verification rule against its closed form (docs/algorithm.md section 2).

The statistical tests draw B >= 200,000 independent rounds in ONE vectorised verify call (p, q expanded over
the batch, drafts x ~ q from torch.multinomial under a seeded generator) and compare:
- the distribution of the first emitted token (x_1 if it was kept, else the correction) with the rule's
  output distribution, within TV 0.01 and within 5 binomial standard deviations per token;
- acceptance frequencies with 1 - TV(q, pi) (acceptance_probability), within 5 standard deviations.
Every seed is fixed, so the suite is deterministic: a failure is a real disagreement, not a flake.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache

import pytest
import torch
import torch.nn.functional as F
from closed_forms import acceptance_probability, verification_target
from torch import Tensor

from diversed.request import RULE_SPECS, TYPICAL_DELTA, TYPICAL_EPSILON
from diversed.verify import (
    RULES,
    Verdict,
    total_variation,
    verify,
)

DRAWS = 200_000
TV_TOLERANCE = 0.01
SIGMAS = 5.0

# ---------------------------------------------------------------------------------------------------------
# Shared helpers (kept here, not in conftest: they are specific to verification tests)
# ---------------------------------------------------------------------------------------------------------


def random_dist(seed: int, vocab: int, scale: float, *, support: slice | None = None) -> Tensor:
    """softmax(randn * scale) over `vocab` tokens in float32: large scale = peaked, small = flat. With
    `support`, the mass outside that slice is set to exactly zero and the rest renormalised."""
    g = torch.Generator().manual_seed(seed)
    probs = torch.softmax(torch.randn(vocab, generator=g, dtype=torch.float64) * scale, -1)
    if support is not None:
        mask = torch.zeros(vocab, dtype=torch.bool)
        mask[support] = True
        probs = torch.where(mask, probs, torch.zeros_like(probs))
        probs = probs / probs.sum()
    return probs.float()


def one_hot(vocab: int, token: int) -> Tensor:
    probs = torch.zeros(vocab)
    probs[token] = 1.0
    return probs


def mixture(p: Tensor, q: Tensor, w: float) -> Tensor:
    """nu = w p + (1 - w) q, computed in float64 independently of the code under test."""
    return w * p.double() + (1.0 - w) * q.double()


def draw_drafts(q: Tensor, batch: int, generator: torch.Generator) -> Tensor:
    """x_i ~ q_i independently for every row: q [N, V] -> long [batch, N]."""
    return torch.multinomial(q, batch, replacement=True, generator=generator).T.contiguous()


def run_rounds(rule: str, q: Tensor, p: Tensor, *, seed: int, batch: int = DRAWS, **params) -> tuple[Tensor,
                                                                                                      Verdict]:
    """`batch` i.i.d. rounds of one (q [N, V], p [N+1, V]) pair in a single verify call.

    The big call skips input validation (on 200k expanded rows it costs as much as the sampling); the same
    input is validated on a two-row slice first, so the default path still has to accept it."""
    g = torch.Generator().manual_seed(seed)
    drafts = draw_drafts(q, batch, g)
    n, v = q.shape
    q_rows, p_rows = q.expand(batch, n, v), p.expand(batch, n + 1, v)
    rows_params = {k: (x[:2] if isinstance(x, Tensor) and x.dim() else x) for k, x in params.items()}
    verify(rule, drafts[:2], q_rows[:2], p_rows[:2], generator=torch.Generator(), **rows_params)
    result = verify(rule, drafts, q_rows, p_rows, generator=g, validate=False, **params)
    return drafts, result


def emitted_at(drafts: Tensor, result: Verdict, position: int) -> tuple[Tensor, Tensor]:
    """The token emitted at drafted `position` (0-based) by the rows that got that far (num_accepted >=
    position): the draft if it was kept, else the correction. Returns (mask of those rows, their tokens)."""
    reached = result.num_accepted >= position
    kept = result.num_accepted > position
    return reached, torch.where(kept, drafts[:, position], result.next_token)[reached]


def first_token(drafts: Tensor, result: Verdict) -> Tensor:
    return torch.where(result.num_accepted > 0, drafts[:, 0], result.next_token)


def assert_distribution(tokens: Tensor, expected: Tensor, what: str) -> None:
    """The empirical distribution of `tokens` is `expected` [V]: TV within 0.01, every token within
    5 binomial standard deviations, and no token where expected has zero mass."""
    n = tokens.numel()
    expected = expected.double()
    assert abs(float(expected.sum()) - 1.0) < 1e-5, f"{what}: expected distribution does not sum to 1"
    empirical = torch.bincount(tokens, minlength=expected.numel()).double() / n
    assert empirical.numel() == expected.numel(), f"{what}: token id outside the vocabulary"
    impossible = (expected == 0) & (empirical > 0)
    assert not impossible.any(), f"{what}: emitted tokens {impossible.nonzero().flatten().tolist()} of mass 0"
    tv = 0.5 * float((empirical - expected).abs().sum())
    assert tv < TV_TOLERANCE, f"{what}: TV(empirical, expected) = {tv:.4f} over {n} draws"
    bound = SIGMAS * torch.sqrt(expected * (1 - expected) / n) + 1e-4
    worst = int(((empirical - expected).abs() - bound).argmax())
    assert ((empirical - expected).abs() <= bound).all(), (
        f"{what}: token {worst} has frequency {empirical[worst]:.5f}, expected {expected[worst]:.5f} "
        f"(+- {bound[worst]:.5f}) over {n} draws")


def assert_rate(successes: Tensor, expected: float, what: str) -> None:
    """Bernoulli frequency within 5 standard deviations (+1e-4) of `expected`."""
    n = successes.numel()
    freq = float(successes.double().mean())
    expected = float(expected)
    bound = SIGMAS * math.sqrt(max(expected * (1 - expected), 0.0) / n) + 1e-4
    assert abs(freq - expected) < bound, (
        f"{what}: frequency {freq:.5f} vs {expected:.5f} (+- {bound:.5f}, n={n})")


def lossy_output(p: Tensor, q: Tensor, lenience: float) -> Tensor:
    """The lossy rule's output distribution, derived from the rule: keep x ~ q with probability
    min(1, p(x)/((1-l) q(x))), else draw from norm(max(0, p - q)):
    min(q, p/(1-l)) + (1 - sum min(q, p/(1-l))) norm(max(0, p - q))."""
    p, q = p.double(), q.double()
    kept = torch.minimum(q, p / (1.0 - lenience))
    residual = (p - q).clamp_min(0)
    return kept + (1.0 - kept.sum()) * residual / residual.sum()


def reference_target(rule: str, p: Tensor, q: Tensor, params: dict) -> Tensor:
    """The verification target pi [V] of the table of docs/algorithm.md section 2.1 for one position, written
    out plainly in float64 (independent of diversed.verify.verification_target)."""
    p, q = p.double(), q.double()
    tv = 0.5 * float((p - q).abs().sum())
    if rule in ("exact", "lossy"):
        return p
    if rule in ("static", "dynamic"):
        return mixture(p, q, float(params["weight"]))
    alpha = params["alpha"]
    if rule == "cascade-chow":
        return q if float(q.max()) >= 1 - alpha else p
    if rule == "cascade-opt":
        return q if float(q.max()) >= float(p.max()) - alpha * tv else p
    if rule == "cascade-token":
        in_a = [float(p[v]) >= (1 - alpha) * float(p.max()) for v in range(len(p))]
        outside_mass = sum(float(q[u]) for u in range(len(q)) if not in_a[u])
        return torch.tensor([float(q[v]) * in_a[v] + outside_mass * float(p[v]) for v in range(len(p))],
                            dtype=torch.float64)
    raise AssertionError(rule)


def expected_output(rule: str, p: Tensor, q: Tensor, params: dict) -> Tensor:
    """Each rule's output distribution at one position (for "dynamic", params carry that position's w)."""
    if rule == "lossy":
        return lossy_output(p, q, params["lenience"])
    return reference_target(rule, p, q, params)


def expected_acceptance(rule: str, p: Tensor, q: Tensor, params: dict) -> float:
    """sum_x q(x) min(1, pi(x)/q(x)) written directly (lossy: pi/q -> p/((1-l) q))."""
    p, q = p.double(), q.double()
    if rule == "lossy":
        return float(torch.minimum(q, p / (1 - params["lenience"])).sum())
    return float(torch.minimum(q, reference_target(rule, p, q, params)).sum())


# ---------------------------------------------------------------------------------------------------------
# Cases with one drafted position (N = 1): first-token distribution and acceptance frequency
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One (q_1, p_1, p_2) triple verified with one rule; params as a tuple of (name, value) so it hashes."""

    rule: str
    pair: str
    param_items: tuple = ()

    @property
    def params(self) -> dict:
        return dict(self.param_items)


def make_case(rule: str, pair: str, **params) -> Case:
    return Case(rule, pair, tuple(sorted(params.items())))


def _pair(name: str) -> tuple[Tensor, Tensor]:
    """q [1, V] and p [2, V] (p_2 is the bonus distribution) for each named pair. V = 20 mostly: the cost of a
    200k-row verify call is dominated by torch.multinomial over [B, V], linear in V."""
    v = 20
    if name == "peaked-p-flat-q":
        p1, q1 = random_dist(1, v, 4.0), random_dist(2, v, 0.5)
    elif name == "flat-p-peaked-q":
        v = 32
        p1, q1 = random_dist(3, v, 0.5), random_dist(4, v, 4.0)
    elif name == "moderate":
        p1, q1 = random_dist(5, v, 1.5), random_dist(6, v, 1.5)
    elif name == "q-zero-where-p-not":
        p1, q1 = random_dist(7, v, 1.0), random_dist(8, v, 1.0, support=slice(0, 10))
    elif name == "p-equals-q":
        p1 = random_dist(9, v, 2.0)
        q1 = p1.clone()
    elif name == "disjoint":
        p1 = random_dist(10, v, 1.0, support=slice(0, 10))
        q1 = random_dist(11, v, 1.0, support=slice(10, 20))
    elif name == "one-hot-q":
        p1, q1 = random_dist(12, v, 1.5), one_hot(v, 5)
    elif name == "one-hot-p":
        p1, q1 = one_hot(v, 7), random_dist(13, v, 1.5)
    else:
        raise AssertionError(name)
    bonus = random_dist(100, v, 1.0)
    return q1.unsqueeze(0), torch.stack([p1, bonus])


SINGLE_POSITION_CASES = [
    *(make_case(rule, pair, **params)
      for pair in ("peaked-p-flat-q", "flat-p-peaked-q", "moderate")
      for rule, params in (("exact", {}), ("static", {"weight": 0.3}), ("static", {"weight": 0.8}),
                           ("lossy", {"lenience": 0.4}), ("cascade-chow", {"alpha": 0.7}),
                           ("cascade-opt", {"alpha": 0.5}), ("cascade-token", {"alpha": 0.5}))),
    make_case("static", "moderate", weight=0.0),
    make_case("static", "moderate", weight=1.0),
    make_case("exact", "q-zero-where-p-not"),
    make_case("static", "q-zero-where-p-not", weight=0.5),
    make_case("cascade-token", "q-zero-where-p-not", alpha=0.7),
    make_case("exact", "p-equals-q"),
    make_case("static", "p-equals-q", weight=0.5),
    make_case("exact", "disjoint"),
    make_case("static", "disjoint", weight=0.5),
    make_case("cascade-token", "disjoint", alpha=0.3),
    make_case("exact", "one-hot-q"),
    make_case("static", "one-hot-q", weight=0.4),
    make_case("cascade-chow", "one-hot-q", alpha=0.0),
    make_case("exact", "one-hot-p"),
    make_case("lossy", "one-hot-p", lenience=0.5),
]


def _case_id(case: Case) -> str:
    params = ",".join(f"{k}={v}" for k, v in case.params.items())
    return f"{case.rule}[{params}]-{case.pair}" if params else f"{case.rule}-{case.pair}"


@cache
def _single_position_run(case: Case) -> tuple[Tensor, Tensor, Tensor, Verdict]:
    """Verified once, shared by the distribution and the acceptance tests of that case."""
    q, p = _pair(case.pair)
    seed = SINGLE_POSITION_CASES.index(case) + 1000
    drafts, result = run_rounds(case.rule, q, p, seed=seed, **case.params)
    return q, p, drafts, result


@pytest.mark.parametrize("case", SINGLE_POSITION_CASES, ids=_case_id)
def test_first_token_follows_rule_output_distribution(case: Case):
    q, p, drafts, result = _single_position_run(case)
    expected = expected_output(case.rule, p[0], q[0], case.params)
    assert_distribution(first_token(drafts, result), expected, f"first token of {_case_id(case)}")


@pytest.mark.parametrize("case", SINGLE_POSITION_CASES, ids=_case_id)
def test_acceptance_frequency_matches_closed_form(case: Case):
    q, p, drafts, result = _single_position_run(case)
    closed_form = float(acceptance_probability(case.rule, p[0], q[0], **case.params))
    direct = expected_acceptance(case.rule, p[0], q[0], case.params)
    assert closed_form == pytest.approx(direct, abs=1e-5), "acceptance_probability disagrees"
    if case.rule == "exact":
        assert direct == pytest.approx(1 - float(total_variation(q[0].double(), p[0].double())), abs=1e-6)
    if case.rule == "static":
        tv = float(total_variation(q[0].double(), p[0].double()))
        assert direct == pytest.approx(1 - case.params["weight"] * tv, abs=1e-6)
    assert_rate(result.num_accepted > 0, closed_form, f"acceptance of {_case_id(case)}")
    # accept_prob is min(1, pi(x)/q(x)) at the drafted x: its mean estimates the same probability.
    assert float(result.accept_prob[:, 0].double().mean()) == pytest.approx(closed_form, abs=0.01)


def test_single_position_cases_exercise_both_cascade_branches():
    """The cascade cases above are only informative if some defer to the draft and some to the target."""
    chosen = {}
    for case in SINGLE_POSITION_CASES:
        if case.rule in ("cascade-chow", "cascade-opt"):
            q, p = _pair(case.pair)
            pi = reference_target(case.rule, p[0], q[0], case.params)
            chosen.setdefault(case.rule, set()).add("draft" if torch.equal(pi, q[0].double()) else "target")
    assert chosen == {"cascade-chow": {"draft", "target"}, "cascade-opt": {"draft", "target"}}


@pytest.mark.parametrize(
    ("pair", "rule", "params", "rate"),
    [("p-equals-q", "exact", {}, 1.0), ("disjoint", "exact", {}, 0.0),
     ("moderate", "static", {"weight": 0.0}, 1.0), ("one-hot-q", "cascade-chow", {"alpha": 0.0}, 1.0),
     ("disjoint", "cascade-token", {"alpha": 0.3}, 0.0)],
)
def test_certain_outcomes_are_certain(pair, rule, params, rate):
    """Where acceptance is 0 or 1 exactly, no draw may deviate (no rounding slack in the ratio test)."""
    _, _, _, result = _single_position_run(make_case(rule, pair, **params))
    assert bool(((result.num_accepted > 0) == bool(rate)).all())


# ---------------------------------------------------------------------------------------------------------
# Several drafted positions: per-position acceptance and conditional distributions
# ---------------------------------------------------------------------------------------------------------


def _close_pairs(n: int, vocab: int, seed: int, noise: float) -> tuple[Tensor, Tensor]:
    """q [n, V], p [n+1, V] with q_i a perturbation of p_i (acceptance high enough that later positions are
    reached by many rows)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n + 1, vocab, generator=g) * 1.5
    p = torch.softmax(logits, -1)
    q = torch.softmax(logits[:n] + noise * torch.randn(n, vocab, generator=g), -1)
    return q, p


MULTI_POSITION_CASES = {
    "exact-N4": ("exact", 4, {}),
    "static-N4-w0.6": ("static", 4, {"weight": 0.6}),
    "dynamic-N3-w(0.2,0.6,0.9)": ("dynamic", 3, {"weight": (0.2, 0.6, 0.9)}),
    "cascade-token-N3-a0.4": ("cascade-token", 3, {"alpha": 0.4}),
}


@cache
def _multi_position_run(name: str):
    rule, n, params = MULTI_POSITION_CASES[name]
    q, p = _close_pairs(n, 20, seed=list(MULTI_POSITION_CASES).index(name) + 10, noise=0.8)
    call_params = dict(params)
    if rule == "dynamic":
        call_params["weight"] = torch.tensor(params["weight"]).expand(DRAWS, n)
    drafts, result = run_rounds(rule, q, p, seed=2000 + n, **call_params)
    per_position = [dict(params, weight=params["weight"][i]) if rule == "dynamic" else params
                    for i in range(n)]
    return rule, q, p, drafts, result, per_position


@pytest.mark.parametrize("name", MULTI_POSITION_CASES)
def test_per_position_acceptance_matches_closed_form(name):
    rule, q, p, drafts, result, per_position = _multi_position_run(name)
    n = q.shape[0]
    survival = 1.0
    for i in range(n):
        a_i = float(acceptance_probability(rule, p[i], q[i], **per_position[i]))
        assert a_i == pytest.approx(expected_acceptance(rule, p[i], q[i], per_position[i]), abs=1e-5)
        reached = result.num_accepted >= i
        assert_rate((result.num_accepted > i)[reached], a_i, f"{name}: acceptance at position {i} if reached")
        survival *= a_i
        assert_rate(result.accepted[:, i], survival, f"{name}: fraction keeping positions 0..{i}")
    # the kept mask is exactly the prefix of length num_accepted
    assert torch.equal(result.accepted, torch.arange(n).expand(DRAWS, n) < result.num_accepted.unsqueeze(1))


@pytest.mark.parametrize("name", MULTI_POSITION_CASES)
def test_each_position_given_earlier_accepted_follows_its_own_target(name):
    """Conditional on positions < i being kept, the token emitted at position i is distributed as pi_i
    (nu_i with that position's own weight for "dynamic")."""
    rule, q, p, drafts, result, per_position = _multi_position_run(name)
    for i in range(q.shape[0]):
        reached, tokens = emitted_at(drafts, result, i)
        assert reached.sum() >= 100_000, f"{name}: too few rows reach position {i} for a TV 0.01 check"
        assert_distribution(tokens, expected_output(rule, p[i], q[i], per_position[i]),
                            f"{name}: emitted token at position {i}")


# ---------------------------------------------------------------------------------------------------------
# Bonus token
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("rule", "params"), [("exact", {}), ("static", {"weight": 0.0}),
                                              ("cascade-chow", {"alpha": 1.0})],
                         ids=["exact-q=p", "static-w0", "cascade-chow-a1"])
def test_bonus_token_after_all_accepted_follows_next_target_distribution(rule, params):
    """All N drafts kept (q = p at drafted positions for exact; w = 0 or a cascade that always defers to
    the draft keep everything whatever p) -> the extra token is drawn from p_{N+1}, not q or nu."""
    n, vocab = 3, 20
    q, p = _close_pairs(n, vocab, seed=31, noise=1.0)
    if rule == "exact":
        q = p[:n].clone()
    p[n] = random_dist(32, vocab, 2.0)
    drafts, result = run_rounds(rule, q, p, seed=33, **params)
    assert bool((result.num_accepted == n).all()), f"{rule}: some drafts rejected though pi_i = q_i"
    # p_{N+1} is far from p_N and q_N, so drawing the bonus from either would fail the check below
    assert float(total_variation(p[n], p[n - 1])) > 0.2 and float(total_variation(p[n], q[n - 1])) > 0.2
    assert_distribution(result.next_token, p[n], f"{rule}: bonus token")


# ---------------------------------------------------------------------------------------------------------
# Exact equivalences under identical seeds
# ---------------------------------------------------------------------------------------------------------


@cache
def _mixed_batch(batch: int = 20_000, n: int = 4, vocab: int = 32, seed: int = 41):
    """Different (q, p, drafts) on every row, peaked and flat, drafts x ~ q."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.exp(torch.randn(batch, 1, 1, generator=g))
    q = torch.softmax(torch.randn(batch, n, vocab, generator=g) * scale, -1)
    p = torch.softmax(torch.randn(batch, n + 1, vocab, generator=g) * scale, -1)
    drafts = torch.multinomial(q.reshape(-1, vocab), 1, generator=g).reshape(batch, n)
    return drafts, q, p


def _same_seed(rule: str, drafts, q, p, **params) -> Verdict:
    return verify(rule, drafts, q, p, generator=torch.Generator().manual_seed(7), **params)


def _assert_same_decisions(a: Verdict, b: Verdict, what: str) -> None:
    assert torch.equal(a.num_accepted, b.num_accepted), f"{what}: num_accepted differs"
    assert torch.equal(a.next_token, b.next_token), f"{what}: next_token differs"
    assert torch.equal(a.accepted, b.accepted), f"{what}: accepted differs"
    n = a.accepted.shape[1]
    outcomes = set(a.num_accepted.tolist())
    assert {0, n} <= outcomes, f"{what}: comparison is vacuous, num_accepted only takes values {outcomes}"


def test_static_with_weight_one_equals_exact_under_same_seed():
    drafts, q, p = _mixed_batch()
    _assert_same_decisions(_same_seed("static", drafts, q, p, weight=1.0), _same_seed("exact", drafts, q, p),
                           "static w=1 vs exact")


def test_lossy_with_zero_lenience_equals_exact_under_same_seed():
    drafts, q, p = _mixed_batch()
    _assert_same_decisions(_same_seed("lossy", drafts, q, p, lenience=0.0), _same_seed("exact", drafts, q, p),
                           "lossy l=0 vs exact")


@pytest.mark.parametrize("lenience", [0.3, 0.9])
def test_lossy_with_a_constant_lenience_per_token_equals_the_scalar_under_same_seed(lenience):
    """A lenience head's tensor [B, N] of one value decides as that single lenience does."""
    drafts, q, p = _mixed_batch()
    _assert_same_decisions(_same_seed("lossy", drafts, q, p, lenience=torch.full(drafts.shape, lenience)),
                           _same_seed("lossy", drafts, q, p, lenience=lenience), f"lossy l=[{lenience}] vs scalar")


def test_lossy_applies_each_tokens_own_lenience():
    """accept_prob at (b, i) is min(1, p(x) / ((1 - l_bi) q(x))) with that position's own l."""
    drafts, q, p = (x[:64] for x in _mixed_batch())
    lenience = torch.rand(drafts.shape, generator=torch.Generator().manual_seed(3)) * 0.99
    result = _same_seed("lossy", drafts, q, p, lenience=lenience)
    p_x, q_x = (d.gather(-1, drafts.unsqueeze(-1)).squeeze(-1) for d in (p[:, :-1], q))
    torch.testing.assert_close(result.accept_prob, (p_x / ((1 - lenience) * q_x)).clamp(max=1.0))


@pytest.mark.parametrize("w", [0.0, 0.35, 1.0])
def test_dynamic_with_constant_weight_equals_static_under_same_seed(w):
    drafts, q, p = _mixed_batch()
    if w == 0.0:  # w = 0 keeps everything: compare, but the vacuity check below does not apply
        a = _same_seed("dynamic", drafts, q, p, weight=torch.zeros(drafts.shape))
        b = _same_seed("static", drafts, q, p, weight=0.0)
        assert bool((a.num_accepted == drafts.shape[1]).all())
        assert torch.equal(a.next_token, b.next_token) and torch.equal(a.num_accepted, b.num_accepted)
        return
    _assert_same_decisions(_same_seed("dynamic", drafts, q, p, weight=torch.full(drafts.shape, w)),
                           _same_seed("static", drafts, q, p, weight=w), f"dynamic w={w} vs static")


def test_same_seed_reproduces_and_other_seed_differs():
    drafts, q, p = _mixed_batch()
    a, b = _same_seed("static", drafts, q, p, weight=0.5), _same_seed("static", drafts, q, p, weight=0.5)
    assert torch.equal(a.next_token, b.next_token) and torch.equal(a.num_accepted, b.num_accepted)
    c = verify("static", drafts, q, p, weight=0.5, generator=torch.Generator().manual_seed(8))
    assert not torch.equal(a.next_token, c.next_token)


# ---------------------------------------------------------------------------------------------------------
# Greedy mode
# ---------------------------------------------------------------------------------------------------------

GREEDY_RULES = [("exact", {}), ("lossy", {"lenience": 0.5}), ("static", {"weight": 0.5}),
                ("static", {"weight": 0.0}), ("dynamic", {}), ("cascade-chow", {"alpha": 0.5}),
                ("cascade-opt", {"alpha": 0.5}), ("cascade-token", {"alpha": 0.5})]
GREEDY_IDS = [f"{r}{list(pr.values()) if pr else ''}" for r, pr in GREEDY_RULES]


def _greedy_batch(batch: int = 64, n: int = 4, vocab: int = 20, seed: int = 51):
    """Drafts = argmax q_i; every target p_i is built so that on each row the first k drafts equal argmax
    p_i (k = row % (N+1)), position k does not, and later positions match again (to test prefix semantics)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.softmax(torch.randn(batch, n, vocab, generator=g) * 2, -1)
    drafts = q.argmax(-1)
    logits = torch.randn(batch, n + 1, vocab, generator=g)
    agree_upto = torch.arange(batch) % (n + 1)
    for b in range(batch):
        for i in range(n):
            target_token = int(drafts[b, i]) if i != agree_upto[b] else (int(drafts[b, i]) + 1) % vocab
            logits[b, i, target_token] += 6.0
    return drafts, q, torch.softmax(logits, -1), agree_upto


def _reference_greedy(rule: str, drafts, q, p, params: dict):
    """Per-row loop: accept while x_i == argmax pi_i; correction argmax pi_i; bonus argmax p_{N+1}."""
    batch, n = drafts.shape
    num, nxt, passed = [], [], torch.zeros(batch, n, dtype=torch.bool)
    for b in range(batch):
        k = None
        for i in range(n):
            row_params = {"weight": float(params["weight"][b, i])} if rule == "dynamic" else params
            pi_i = reference_target(rule, p[b, i], q[b, i], row_params)
            passed[b, i] = int(drafts[b, i]) == int(pi_i.argmax())
            if k is None and not passed[b, i]:
                k, correction = i, int(pi_i.argmax())
        num.append(n if k is None else k)
        nxt.append(int(p[b, n].argmax()) if k is None else correction)
    return torch.tensor(num), torch.tensor(nxt), passed


@pytest.mark.parametrize(("rule", "params"), GREEDY_RULES, ids=GREEDY_IDS)
def test_greedy_accepts_prefix_matching_argmax_of_rule_target(rule, params):
    drafts, q, p, _ = _greedy_batch()
    if rule == "dynamic":
        params = {"weight": torch.rand(drafts.shape, generator=torch.Generator().manual_seed(52))}
    result = verify(rule, drafts, q, p, greedy=True, **params)
    num, nxt, passed = _reference_greedy(rule, drafts, q, p, params)
    assert torch.equal(result.num_accepted, num)
    assert torch.equal(result.next_token, nxt)
    assert torch.equal(result.accept_prob, passed.float())
    assert torch.equal(result.accepted, torch.arange(drafts.shape[1]) < num.unsqueeze(1))


def test_greedy_exact_stops_at_first_mismatch_with_argmax_p():
    drafts, q, p, agree_upto = _greedy_batch()
    result = verify("exact", drafts, q, p, greedy=True)
    n = drafts.shape[1]
    assert torch.equal(result.num_accepted, agree_upto)
    argmax_p = p.argmax(-1)
    expected_next = argmax_p[torch.arange(len(drafts)), agree_upto]  # argmax p_k, or argmax p_{N+1} if k = N
    assert torch.equal(result.next_token, expected_next)
    # later positions agree again, yet are not kept
    later = (agree_upto < n - 1)
    assert bool((drafts[later, -1] == argmax_p[later, n - 1]).all())
    assert not result.accepted[later, -1].any()


def test_greedy_static_uses_argmax_of_mixture_not_of_p_or_q():
    """p peaks on token 0, q on token 1, the mixture at w = 0.5 on token 2: greedy static must follow nu."""
    vocab = 20
    p1 = torch.full((vocab,), 0.05 / 17)
    p1[0], p1[1], p1[2] = 0.5, 0.0, 0.45
    q1 = torch.full((vocab,), 0.0)
    q1[1], q1[2] = 0.6, 0.4
    q = q1.expand(3, 1, vocab)
    p = torch.stack([p1, random_dist(61, vocab, 2.0)]).expand(3, 2, vocab)
    assert int(mixture(p1, q1, 0.5).argmax()) == 2
    drafts = torch.tensor([[0], [1], [2]])
    result = verify("static", drafts, q, p, weight=0.5, greedy=True)
    assert result.num_accepted.tolist() == [0, 0, 1]
    assert result.next_token.tolist() == [2, 2, int(p[0, 1].argmax())]
    exact = verify("exact", drafts, q, p, greedy=True)
    assert exact.num_accepted.tolist() == [1, 0, 0] and exact.next_token.tolist()[1:] == [0, 0]


def test_greedy_bonus_is_argmax_of_p_not_of_mixture():
    vocab = 20
    q = one_hot(vocab, 3).expand(1, 1, vocab)
    bonus = torch.full((vocab,), 0.5 / (vocab - 1))
    bonus[9] = 0.5
    p = torch.stack([one_hot(vocab, 3), bonus]).unsqueeze(0)
    result = verify("static", torch.tensor([[3]]), q, p, weight=0.1, greedy=True)
    assert result.num_accepted.tolist() == [1] and result.next_token.tolist() == [9]


def test_greedy_ignores_the_generator():
    drafts, q, p, _ = _greedy_batch()
    a = verify("static", drafts, q, p, weight=0.5, greedy=True, generator=torch.Generator().manual_seed(1))
    b = verify("static", drafts, q, p, weight=0.5, greedy=True, generator=torch.Generator().manual_seed(2))
    assert torch.equal(a.next_token, b.next_token) and torch.equal(a.num_accepted, b.num_accepted)


# ---------------------------------------------------------------------------------------------------------
# Typical acceptance
# ---------------------------------------------------------------------------------------------------------


def _typical_batch(batch: int = 4096, n: int = 4, vocab: int = 32, seed: int = 71):
    g = torch.Generator().manual_seed(seed)
    scale = torch.exp(1.2 * torch.randn(batch, 1, 1, generator=g))  # from nearly uniform to nearly one-hot
    p = torch.softmax(torch.randn(batch, n + 1, vocab, generator=g) * scale, -1)
    q = torch.softmax(torch.randn(batch, n, vocab, generator=g), -1)
    random_tokens = torch.randint(vocab, (batch, n), generator=g)
    use_argmax = torch.rand(batch, n, generator=g) < 0.6
    drafts = torch.where(use_argmax, p[:, :n].argmax(-1), random_tokens)
    return drafts, q, p


@pytest.mark.parametrize(("epsilon", "delta"), [(None, None), (0.2, 0.5), (0.05, 0.1)])
def test_typical_accepts_exactly_when_probability_exceeds_threshold(epsilon, delta):
    drafts, q, p = _typical_batch()
    n = drafts.shape[1]
    eps = TYPICAL_EPSILON if epsilon is None else epsilon
    dlt = TYPICAL_DELTA if delta is None else delta
    pd = p[:, :n].double()
    entropy = -(pd * torch.log(pd.clamp_min(1e-300))).sum(-1)
    threshold = torch.minimum(torch.full_like(entropy, eps), dlt * torch.exp(-entropy))
    p_x = pd.gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
    assert float(((p_x - threshold).abs() / threshold).min()) > 1e-4, "test data too close to the threshold"
    passes = p_x > threshold
    assert passes.any() and (~passes).any()
    eps_branch = eps < dlt * torch.exp(-entropy)
    assert eps_branch.any() and (~eps_branch).any(), "both sides of min(eps, delta exp(-H)) must be exercised"

    kwargs = {k: v for k, v in (("epsilon", epsilon), ("delta", delta)) if v is not None}
    result = verify("typical", drafts, q, p, generator=torch.Generator().manual_seed(0), **kwargs)
    assert torch.equal(result.accept_prob, passes.float())
    expected_num = passes.long().cumprod(-1).sum(-1)
    assert torch.equal(result.num_accepted, expected_num)
    assert torch.equal(result.accepted, torch.arange(n) < expected_num.unsqueeze(1))
    # deterministic and blind to q
    other = verify("typical", drafts, q.flip(-1), p, generator=torch.Generator().manual_seed(5), **kwargs)
    assert torch.equal(other.num_accepted, result.num_accepted)
    # greedy: next token is argmax of p at the first rejection (p_{N+1} when all kept)
    greedy = verify("typical", drafts, q, p, greedy=True, **kwargs)
    assert torch.equal(greedy.num_accepted, expected_num)
    assert torch.equal(greedy.next_token, p[torch.arange(len(p)), expected_num].argmax(-1))


def test_typical_samples_next_token_from_p_at_first_rejection_or_bonus():
    """First half of the batch drafts a token of tiny p (rejected at position 0: next ~ p_1); the second half
    drafts argmax of peaked p_i (all kept: next ~ p_{N+1})."""
    n, vocab = 2, 20
    p = torch.stack([random_dist(81 + i, vocab, 3.0) for i in range(n + 1)])
    q = torch.full((n, vocab), 1.0 / vocab)
    low, high = p[0].argmin(), p[:n].argmax(-1)
    assert float(p[0, low]) < 0.01 and bool((p[:n].max(-1).values > TYPICAL_EPSILON).all())
    drafts = torch.cat([torch.stack([low, high[1]]).expand(DRAWS, n), high.expand(DRAWS, n)])
    result = verify("typical", drafts, q.expand(2 * DRAWS, n, vocab), p.expand(2 * DRAWS, n + 1, vocab),
                    generator=torch.Generator().manual_seed(82), validate=False)
    assert bool((result.num_accepted[:DRAWS] == 0).all()) and bool((result.num_accepted[DRAWS:] == n).all())
    assert_distribution(result.next_token[:DRAWS], p[0], "typical correction at position 0")
    assert_distribution(result.next_token[DRAWS:], p[n], "typical bonus")


# ---------------------------------------------------------------------------------------------------------
# Batch semantics
# ---------------------------------------------------------------------------------------------------------


def test_batch_rows_are_verified_independently():
    """Rows cycle through three kinds: p = q (all kept), disjoint supports (rejected at position 0,
    correction from p_1's support), and a generic pair (first token ~ p_1). Each row must follow its own
    distributions."""
    n, vocab, per_kind = 2, 20, 100_000
    same_p = torch.stack([random_dist(90 + i, vocab, 2.0) for i in range(n + 1)])
    disjoint_p = torch.stack([random_dist(93 + i, vocab, 1.0, support=slice(0, 10)) for i in range(n + 1)])
    disjoint_q = torch.stack([random_dist(96 + i, vocab, 1.0, support=slice(10, 20)) for i in range(n)])
    generic_q, generic_p = _close_pairs(n, vocab, seed=99, noise=2.0)
    kinds_q = torch.stack([same_p[:n], disjoint_q, generic_q])
    kinds_p = torch.stack([same_p, disjoint_p, generic_p])
    kind = torch.arange(3 * per_kind) % 3  # interleaved, so a row mix-up cannot go unnoticed
    q, p = kinds_q[kind], kinds_p[kind]
    g = torch.Generator().manual_seed(100)
    drafts = torch.multinomial(q.reshape(-1, vocab), 1, generator=g).reshape(-1, n)
    result = verify("exact", drafts, q, p, generator=g)

    assert bool((result.num_accepted[kind == 0] == n).all())
    assert bool((result.num_accepted[kind == 1] == 0).all())
    assert bool((result.next_token[kind == 1] < 10).all())
    generic = kind == 2
    assert_distribution(first_token(drafts[generic], _rows(result, generic)), generic_p[0], "generic rows")


def _rows(result: Verdict, mask: Tensor) -> Verdict:
    return Verdict(result.num_accepted[mask], result.next_token[mask], result.accepted[mask],
                        result.accept_prob[mask], result.uniform[mask])


def test_dynamic_weight_is_applied_per_row():
    """Half the batch has w = 0.1, half w = 0.9 (interleaved): each half's first token follows its own nu."""
    q, p = _pair("moderate")
    vocab = q.shape[-1]
    weights = torch.tensor([0.1, 0.9]).repeat(DRAWS).unsqueeze(1)
    g = torch.Generator().manual_seed(101)
    drafts = draw_drafts(q, 2 * DRAWS, g)
    result = verify("dynamic", drafts, q.expand(2 * DRAWS, 1, vocab), p.expand(2 * DRAWS, 2, vocab),
                    weight=weights, generator=g, validate=False)
    for w in (0.1, 0.9):
        rows = weights[:, 0] == w
        assert_distribution(first_token(drafts[rows], _rows(result, rows)), mixture(p[0], q[0], w),
                            f"dynamic rows with w={w}")
        assert_rate(result.num_accepted[rows] > 0, 1 - w * float(total_variation(q[0], p[0])),
                    f"dynamic rows with w={w}")


@pytest.mark.parametrize(("rule", "params"), [*GREEDY_RULES, ("typical", {})],
                         ids=[*GREEDY_IDS, "typical"])
def test_batched_greedy_equals_row_by_row(rule, params):
    drafts, q, p, _ = _greedy_batch(batch=16)
    if rule == "dynamic":
        params = {"weight": torch.rand(drafts.shape, generator=torch.Generator().manual_seed(53))}
    batched = verify(rule, drafts, q, p, greedy=True, **params)
    for b in range(len(drafts)):
        row_params = {"weight": params["weight"][b:b + 1]} if rule == "dynamic" else params
        single = verify(rule, drafts[b:b + 1], q[b:b + 1], p[b:b + 1], greedy=True, **row_params)
        assert int(single.num_accepted) == int(batched.num_accepted[b]), f"row {b}"
        assert int(single.next_token) == int(batched.next_token[b]), f"row {b}"


def test_output_types_and_shapes():
    drafts, q, p = _mixed_batch(batch=8, n=3)
    result = verify("static", drafts, q, p, weight=0.5, generator=torch.Generator().manual_seed(0))
    assert result.num_accepted.dtype == torch.long and result.num_accepted.shape == (8,)
    assert result.next_token.dtype == torch.long and result.next_token.shape == (8,)
    assert result.accepted.dtype == torch.bool and result.accepted.shape == (8, 3)
    assert result.accept_prob.is_floating_point() and result.accept_prob.shape == (8, 3)
    assert bool(((result.accept_prob >= 0) & (result.accept_prob <= 1)).all())


def test_empty_batch_is_accepted():
    vocab = 8
    result = verify("exact", torch.zeros(0, 2, dtype=torch.long), torch.full((0, 2, vocab), 1 / vocab),
                    torch.full((0, 3, vocab), 1 / vocab))
    assert result.num_accepted.shape == (0,) and result.next_token.shape == (0,)


def test_low_precision_inputs_are_upcast():
    """Sampled, so the float16 and float32 runs would part at the first ratio computed in half precision."""
    drafts, q, p = _mixed_batch(batch=64, n=2, vocab=16)
    # float16 rounding keeps row sums within the tolerance for these flat-ish rows
    a, b = (verify("static", drafts, q_, p_, weight=0.37, generator=torch.Generator().manual_seed(0))
            for q_, p_ in ((q.half(), p.half()), (q.half().float(), p.half().float())))
    assert a.accept_prob.dtype == torch.float32 and torch.equal(a.accept_prob, b.accept_prob)
    assert torch.equal(a.num_accepted, b.num_accepted) and torch.equal(a.next_token, b.next_token)


# ---------------------------------------------------------------------------------------------------------
# verification_target against the table
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("rule", "params"), [
    ("exact", {}), ("lossy", {"lenience": 0.3}), ("static", {"weight": 0.0}), ("static", {"weight": 0.42}),
    ("static", {"weight": 1.0}), ("cascade-chow", {"alpha": 0.3}), ("cascade-chow", {"alpha": 0.7}),
    ("cascade-opt", {"alpha": 0.2}), ("cascade-opt", {"alpha": 0.9}), ("cascade-token", {"alpha": 0.0}),
    ("cascade-token", {"alpha": 0.3}), ("cascade-token", {"alpha": 1.0}),
])
def test_verification_target_matches_table(rule, params):
    pairs = [(random_dist(s, 24, sp), random_dist(s + 50, 24, sq))
             for s, (sp, sq) in enumerate([(4, 0.5), (0.5, 4), (1.5, 1.5), (3, 3), (0.2, 0.2)])]
    target_params = {k: v for k, v in params.items() if k != "lenience"}  # lossy verifies against p itself
    for p, q in pairs:
        pi = verification_target(rule, p, q, **target_params)
        assert torch.allclose(pi.double(), reference_target(rule, p, q, params), atol=1e-6), (rule, params)
        assert float(pi.min()) >= 0 and float(pi.sum()) == pytest.approx(1.0, abs=1e-5)
    # batched [B, N, V] gives the same as one position at a time
    p_all, q_all = torch.stack([p for p, _ in pairs]), torch.stack([q for _, q in pairs])
    batched = verification_target(rule, p_all.unsqueeze(1), q_all.unsqueeze(1), **target_params)
    for k, (p, q) in enumerate(pairs):
        assert torch.allclose(batched[k, 0], verification_target(rule, p, q, **target_params))


def test_verification_target_dynamic_weight_per_position():
    q, p = _close_pairs(3, 20, seed=5, noise=1.0)
    w = torch.tensor([[0.1, 0.5, 0.95], [1.0, 0.0, 0.3]])
    pi = verification_target("dynamic", p[:3].expand(2, 3, 20), q.expand(2, 3, 20), weight=w)
    for b in range(2):
        for i in range(3):
            assert torch.allclose(pi[b, i].double(), mixture(p[i], q[i], float(w[b, i])), atol=1e-6)


def test_verification_target_rejects_typical_and_unknown_rules():
    p = q = torch.full((4,), 0.25)
    for rule in ("typical", "nope"):
        with pytest.raises(ValueError, match="rule"):
            verification_target(rule, p, q)


# ---------------------------------------------------------------------------------------------------------
# Input validation
# ---------------------------------------------------------------------------------------------------------

_B, _N, _V = 3, 2, 8


def _valid(rule: str = "exact"):
    g = torch.Generator().manual_seed(0)
    q = torch.softmax(torch.randn(_B, _N, _V, generator=g), -1)
    p = torch.softmax(torch.randn(_B, _N + 1, _V, generator=g), -1)
    drafts = torch.randint(_V, (_B, _N), generator=g)
    return drafts, q, p


def _unnormalised(x: Tensor, where: tuple, value: float) -> Tensor:
    x = x.clone()
    x[where] = value
    return x


def _negative(x: Tensor) -> Tensor:
    """One entry made negative, its row still summing to 1."""
    x = x.clone()
    x[0, 0, 1] += float(x[0, 0, 0]) + 0.05
    x[0, 0, 0] = -0.05
    return x


BAD_INPUTS = {
    # name: (rule, mutate(drafts, q, p) -> (drafts, q, p), params, match)
    "draft_probs batch mismatch": ("exact", lambda d, q, p: (d, q[:2], p), {}, "draft_probs"),
    "draft_probs length mismatch": ("exact", lambda d, q, p: (d, q[:, :1], p), {}, "draft_probs"),
    "draft_probs not 3-d": ("exact", lambda d, q, p: (d, q[0], p), {}, "draft_probs"),
    "target_probs without N+1": ("exact", lambda d, q, p: (d, q, p[:, :_N]), {}, "target_probs"),
    "target_probs batch mismatch": ("exact", lambda d, q, p: (d, q, p[:2]), {}, "target_probs"),
    "vocabularies differ": ("exact", lambda d, q, p: (d, q, torch.cat([p, torch.zeros(_B, _N + 1, 1)], -1)),
                            {}, "target_probs.*vocabulary"),
    "draft_tokens 1-d": ("exact", lambda d, q, p: (d[:, 0], q, p), {}, "draft_tokens"),
    "draft_tokens not long": ("exact", lambda d, q, p: (d.int(), q, p), {}, "draft_tokens"),
    "token id too large": ("exact", lambda d, q, p: (_unnormalised(d, (1, 1), _V), q, p), {}, "draft_tokens"),
    "token id negative": ("exact", lambda d, q, p: (_unnormalised(d, (0, 0), -1), q, p), {}, "draft_tokens"),
    "N = 0": ("exact", lambda d, q, p: (d[:, :0], q[:, :0], p[:, :1]), {}, "draft_tokens.*N = 0"),
    "negative draft_probs": ("exact", lambda d, q, p: (d, _negative(q), p), {}, "draft_probs.*negative"),
    "negative target_probs": ("exact", lambda d, q, p: (d, q, _negative(p)), {}, "target_probs.*negative"),
    "NaN draft_probs": ("exact", lambda d, q, p: (d, _unnormalised(q, (0, 0, 0), float("nan")), p), {},
                        "draft_probs.*NaN"),
    "NaN target_probs": ("exact", lambda d, q, p: (d, q, _unnormalised(p, (2, 1, 3), float("nan"))), {},
                         "target_probs.*NaN"),
    "inf target_probs": ("exact", lambda d, q, p: (d, q, _unnormalised(p, (2, 1, 3), float("inf"))), {},
                         "target_probs"),
    "draft_probs rows not summing to 1": ("exact", lambda d, q, p: (d, q * 1.01, p), {},
                                          "draft_probs.*sum to 1"),
    "target_probs rows not summing to 1": ("exact", lambda d, q, p: (d, q, p * 0.99), {},
                                           "target_probs.*sum to 1"),
    "static weight above 1": ("static", None, {"weight": 1.5}, r"weight.*\[0, 1\]"),
    "static weight below 0": ("static", None, {"weight": -0.1}, r"weight.*\[0, 1\]"),
    "static weight NaN": ("static", None, {"weight": float("nan")}, "weight"),
    "static weight per position": ("static", None, {"weight": torch.full((_B, _N), 0.5)}, "weight.*dynamic"),
    "dynamic weight above 1": ("dynamic", None, {"weight": torch.full((_B, _N), 1.2)}, r"weight.*\[0, 1\]"),
    "dynamic weight below 0": ("dynamic", None, {"weight": torch.full((_B, _N), -0.2)}, r"weight.*\[0, 1\]"),
    "dynamic weight wrong shape": ("dynamic", None, {"weight": torch.full((_B, _N + 1), 0.5)}, "weight"),
    "dynamic weight per row only": ("dynamic", None, {"weight": torch.full((_B,), 0.5)}, "weight"),
    "dynamic weight a float": ("dynamic", None, {"weight": 0.5}, "weight"),
    "lenience 1": ("lossy", None, {"lenience": 1.0}, r"lenience.*\[0, 1\)"),
    "lenience negative": ("lossy", None, {"lenience": -0.1}, "lenience"),
    "lenience NaN": ("lossy", None, {"lenience": float("nan")}, "lenience"),
    "lenience per position of 1": ("lossy", None, {"lenience": torch.full((_B, _N), 1.0)}, r"lenience.*\[0, 1\)"),
    "lenience per position NaN": ("lossy", None, {"lenience": torch.full((_B, _N), float("nan"))}, "lenience"),
    "lenience per position wrong shape": ("lossy", None, {"lenience": torch.full((_B, _N + 1), 0.5)},
                                          r"lenience.*\[B, N\]"),
    "lenience per position for lossy-entropy": ("lossy-entropy", None, {"lenience": torch.full((_B, _N), 0.5)},
                                                "lenience.*single number.*'lossy'"),
    "chow alpha above 1": ("cascade-chow", None, {"alpha": 1.1}, r"alpha.*\[0, 1\]"),
    "opt alpha negative": ("cascade-opt", None, {"alpha": -0.1}, r"alpha.*\[0, 1\]"),
    "token alpha NaN": ("cascade-token", None, {"alpha": float("nan")}, "alpha"),
    "typical epsilon zero": ("typical", None, {"epsilon": 0.0}, "epsilon"),
    "typical delta negative": ("typical", None, {"delta": -1.0}, "delta"),
    "unknown rule": ("speculative", None, {}, "rule"),
    "weight given to exact": ("exact", None, {"weight": 0.5}, "weight.*exact"),
    "alpha given to static": ("static", None, {"weight": 0.5, "alpha": 0.1}, "alpha.*static"),
    "lenience given to cascade": ("cascade-token", None, {"alpha": 0.5, "lenience": 0.1}, "lenience"),
    "weight given to lossy": ("lossy", None, {"lenience": 0.1, "weight": 0.5}, "weight.*lossy"),
    "epsilon given to exact": ("exact", None, {"epsilon": 0.1}, "epsilon"),
    "weight given to typical": ("typical", None, {"weight": 0.5}, "weight.*typical"),
    "static without weight": ("static", None, {}, "weight"),
    "dynamic without weight": ("dynamic", None, {}, "weight"),
    "lossy without lenience": ("lossy", None, {}, "lenience"),
    "cascade-chow without alpha": ("cascade-chow", None, {}, "alpha"),
    "cascade-opt without alpha": ("cascade-opt", None, {}, "alpha"),
    "cascade-token without alpha": ("cascade-token", None, {}, "alpha"),
}


@pytest.mark.parametrize("name", BAD_INPUTS)
def test_bad_input_raises_value_error_naming_the_argument(name):
    rule, mutate, params, match = BAD_INPUTS[name]
    drafts, q, p = _valid()
    if mutate is not None:
        drafts, q, p = mutate(drafts, q, p)
    for greedy in (False, True):
        with pytest.raises(ValueError, match=match):
            verify(rule, drafts, q, p, greedy=greedy, generator=torch.Generator().manual_seed(0), **params)


def test_every_rule_accepts_its_valid_parameters():
    """The validation must not reject good input: each rule with exactly its parameters runs."""
    drafts, q, p = _valid()
    params = {"exact": {}, "lossy": {"lenience": 0.0}, "static": {"weight": 1},
              "dynamic": {"weight": torch.ones(_B, _N)}, "cascade-chow": {"alpha": 0.0},
              "cascade-opt": {"alpha": 1.0}, "cascade-token": {"alpha": 0.5},
              "typical": {"epsilon": 0.1, "delta": 0.2}, "lossy-entropy": {"lenience": 0.5, "entropy_threshold": 0.0},
              "cactus": {"delta": 0.0}, "judi": {"epsilon": 0.0, "max_confidence": 1.0}}
    assert set(params) == set(RULES)
    for rule in RULES:
        result = verify(rule, drafts, q, p, generator=torch.Generator().manual_seed(0), **params[rule])
        assert result.num_accepted.shape == (_B,)
    verify("lossy", drafts, q, p, lenience=torch.full((_B, _N), 0.5))  # a lenience per drafted token too
    # float32 rounding in the row sums is tolerated
    verify("exact", drafts, q * (1 + 1e-5), p * (1 - 1e-5))


@pytest.mark.parametrize("end", ["low", "high"])
@pytest.mark.parametrize("greedy", [False, True])
def test_every_rule_decides_at_both_ends_of_the_range_a_request_may_give(end, greedy):
    """The ends of each parameter's range (diversed.request: the largest float32 where it has no upper bound)
    give a verdict of real tokens, not an overflow or NaN."""
    drafts, q, p = _valid()
    for rule, spec in RULE_SPECS.items():
        if rule == "dynamic":  # its weights are a tensor, in [0, 1] as static's
            continue
        params = {}
        for name in spec.parameters:
            allowed = spec.range(name)
            if end == "low":
                params[name] = math.nextafter(allowed.low, math.inf) if allowed.low_open else allowed.low
            elif allowed.high == math.inf:
                params[name] = torch.finfo(torch.float32).max
            else:
                params[name] = math.nextafter(allowed.high, -math.inf) if allowed.high_open else allowed.high
            assert params[name] in allowed
        result = verify(rule, drafts, q, p, greedy=greedy, generator=torch.Generator().manual_seed(0), **params)
        assert ((0 <= result.num_accepted) & (result.num_accepted <= _N)).all(), rule
        assert ((0 <= result.next_token) & (result.next_token < q.shape[-1])).all(), rule


@pytest.mark.parametrize("rule, parameters", [
    ("exact", {}), ("lossy", {"lenience": 0.5}), ("lossy-entropy", {"lenience": 0.5}), ("cactus", {"delta": 0.3}),
    ("static", {"weight": 0.4}), ("cascade-opt", {"alpha": 0.2}), ("judi", {"epsilon": 0.1}), ("typical", {})])
@pytest.mark.parametrize("greedy", [False, True])
def test_copied_drafts_as_ids_decide_as_their_one_hot_rows_would(rule, parameters, greedy):
    """draft_probs None (drafts copied from text) is the point masses: the same decisions, draws and tokens as
    the one-hot rows, which the rules that never read q over the vocabulary no longer build."""
    g = torch.Generator().manual_seed(3)
    p = torch.softmax(torch.randn(64, 5, 50, generator=g) * 2, -1)
    drafts = torch.randint(50, (64, 4), generator=g)
    out = [verify(rule, drafts, q, p, greedy=greedy, generator=torch.Generator().manual_seed(0), **parameters)
           for q in (None, F.one_hot(drafts, 50).float())]
    for field in ("num_accepted", "next_token", "accepted", "accept_prob", "uniform"):
        assert torch.equal(getattr(out[0], field), getattr(out[1], field)) or (
            field == "uniform" and bool(torch.isnan(out[0].uniform).all() and torch.isnan(out[1].uniform).all()))

"""Provenance: how each token was made (diversed.decoding.provenance), from the verifier's draws to generate()."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import binomtest

from diversed.decoding.provenance import ORIGINS, round_origins
from diversed.generation import generate
from diversed.models.loading import Pair
from diversed.verify import exact_acceptance, verify

from tiny import WORDS, perturbed, tiny_model, word_tokenizer


@pytest.mark.parametrize("rule, parameters", [("lossy", {"lenience": 0.6}), ("static", {"weight": 0.3}),
                                               ("cactus", {"delta": 0.5})])
def test_relaxed_tokens_are_those_exact_rejects_on_the_same_draw(rule, parameters):
    """On one block repeated, a draft is 'relaxed' (kept, and u >= exact's acceptance) with probability
    a_rule - a_exact: the rule's extra acceptance over exact, nothing else."""
    g = torch.Generator().manual_seed(0)
    vocab, rows = 6, 20_000
    p = torch.tensor([0.05, 0.4, 0.2, 0.15, 0.1, 0.1])
    q = torch.tensor([0.3, 0.1, 0.1, 0.2, 0.2, 0.1])
    drafts = torch.zeros(rows, 1, dtype=torch.long)  # x = 0: q(x) = 0.3 > p(x) = 0.05, exact keeps it 1/6 of times
    out = verify(rule, drafts, q.expand(rows, 1, vocab), p.expand(rows, 2, vocab), generator=g, **parameters)
    exact = exact_acceptance(drafts, q.expand(rows, 1, vocab), p.expand(rows, 2, vocab), greedy=False)
    relaxed = out.accepted & (out.uniform >= exact)
    extra = float(out.accept_prob[0, 0] - exact[0, 0])
    assert extra > 0.05
    assert binomtest(int(relaxed.sum()), rows, extra).pvalue > 1e-3
    assert not bool((~out.accepted & (out.uniform < exact)).any())  # these rules are never stricter than exact


def test_a_greedy_rule_relaxes_exactly_the_drafts_that_are_not_the_targets_top_token():
    p = torch.tensor([[[0.5, 0.3, 0.2], [0.1, 0.6, 0.3], [0.2, 0.2, 0.6]]])
    q = torch.tensor([[[0.9, 0.05, 0.05], [0.9, 0.05, 0.05]]])
    drafts = torch.tensor([[0, 0]])  # the first is p's top token, the second is not
    out = verify("static", drafts, q, p, weight=0.2, greedy=True)
    assert out.num_accepted.tolist() == [2]
    origins = round_origins(drafts[0], q[0], p[0], out.accept_prob[0], out.uniform[0], int(out.next_token[0]), 2,
                            True, "model", 4)
    assert [o.origin for o in origins] == ["kept", "relaxed", "bonus"]
    assert [o.exact_acceptance for o in origins[:2]] == [1.0, 0.0]
    assert all(o.round == 4 and o.drafted == 2 and o.drafter == "model" for o in origins)
    assert origins[2].p == pytest.approx(0.6)


def test_a_rejection_ends_the_round_with_its_correction_and_a_row_without_drafts_is_the_targets():
    p = torch.tensor([[0.1, 0.6, 0.3], [0.7, 0.2, 0.1]])
    q = torch.tensor([[0.2, 0.7, 0.1]])
    drafts = torch.tensor([2])
    origins = round_origins(drafts, q, p, torch.tensor([0.25]), torch.tensor([0.9]), 1, 0, False, "lookup", 1)
    (correction,) = origins
    assert (correction.origin, correction.rejected_token_id, correction.q, correction.p) == \
        ("correction", 2, pytest.approx(0.1), pytest.approx(0.6))
    (alone,) = round_origins(drafts[:0], q[:0], p[:1], torch.empty(0), torch.empty(0), 1, 0, False, None, 2)
    assert (alone.origin, alone.drafted, alone.p) == ("target", 0, pytest.approx(0.6))


def test_generate_reports_an_origin_for_every_token_in_step_with_the_text():
    target = tiny_model(0, vocab=WORDS, hidden=32)
    pair = Pair(perturbed(target, 0.3, 1), target, word_tokenizer(), "tiny-draft", "tiny-target")
    prompts = ["t3 t4 t5", "t7 t8", "t9 t3 t9 t3"]
    for verification, temperature in (("lossy:0.9", 1.0), ("static:0.2", 1.0), ("exact", 0.0)):
        completions = generate(pair, prompts, verification=verification, temperature=temperature, max_new_tokens=20,
                               chat=False, batch_size=3, draft_length=4, provenance=True, stop=["t11"], seed=1)
        for c in completions:
            assert len(c.provenance) == len(c.tokens) == c.metrics["new_tokens"]
            assert [r["token_id"] for r in c.provenance] == c.tokens
            assert "".join(r["token"] for r in c.provenance).split("t11")[0] == c.text
            assert {r["origin"] for r in c.provenance} <= set(ORIGINS)
            kept = sum(r["origin"] in ("kept", "relaxed") for r in c.provenance)
            assert kept <= c.metrics["accepted"]
    relaxed = [r for c in generate(pair, prompts * 3, verification="lossy:0.9", temperature=1.0, max_new_tokens=20,
                                   chat=False, batch_size=9, draft_length=4, provenance=True, seed=2)
               for r in c.provenance if r["origin"] == "relaxed"]
    assert relaxed and all(r["exact_acceptance"] < r["acceptance"] for r in relaxed)
    assert generate(pair, "t3", max_new_tokens=4, chat=False)[0].provenance is None  # only when asked for

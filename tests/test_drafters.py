"""Drafters (diversed.decoding.drafters): prompt lookup, the shared suffix cache, the auto choice, and every rule
on point-mass drafts, on tiny models and toy distributions."""

from __future__ import annotations

import pytest
import torch
from closed_forms import acceptance_probability

from diversed.backends import as_model
from diversed.decoding.drafters import make_drafter, prediction_tokens
from diversed.decoding.drafters.base import RUN_PRIOR, Acceptance
from diversed.decoding.drafters.lookup import LookupDrafter
from diversed.decoding.drafters.prediction import PRIOR as PREDICTION_PRIOR
from diversed.decoding.drafters.prediction import RUN_PRIOR as PREDICTION_RUN_PRIOR
from diversed.decoding.drafters.prediction import Prediction, PredictionDrafter
from diversed.decoding.drafters.suffix import SuffixCache, SuffixDrafter
from diversed.decoding.engine import Batch, Job, decode
from diversed.decoding.policy import Policy
from diversed.head.model import HeadConfig, build
from diversed.request import DRAFTERS, Drafting, Sampling, Verification

from tiny import perturbed, tiny_model

GREEDY = Sampling(0)
# Prompts that repeat themselves, so that copying finds something.
PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6, 3, 1, 4], [9, 2, 6, 5, 9, 2, 6], [5, 3, 5, 8, 9, 7, 9, 5, 3, 5], [2, 7, 2, 7, 2]]


@pytest.fixture(scope="module")
def models():
    target = tiny_model(0)
    return as_model(target), as_model(perturbed(target, 0.05, 1))


def test_lookup_proposes_what_followed_the_longest_earlier_match():
    drafter = LookupDrafter()
    drafter.add([7, 1, 2, 3, 4, 5, 8, 2, 3, 9, 1, 2, 3])  # "1 2 3" came before "4 5": "2 3" alone before "9" too
    (candidate,) = drafter.candidates([4])
    assert candidate.tokens == [4, 5, 8, 2]
    drafter.add([5, 6, 7])  # nothing repeats
    assert drafter.candidates([4, 4])[1] is None


def test_lookup_keeps_copying_from_the_place_it_follows():
    """The 8 tokens 1..8 occur twice: an answer that copies the first occurrence goes on with what follows it
    there, where a fresh lookup of its latest 8 tokens would jump to the second."""
    repeated = list(range(1, 9))
    drafter = LookupDrafter()
    drafter.add([40, *repeated, 20, 21, *repeated, 30, 31, 99, 40])  # the answer has begun with 40
    assert drafter.candidates([3])[0].tokens == [1, 2, 3]
    drafter.advance([[1, 2, 3]])
    assert drafter.candidates([5])[0].tokens == [4, 5, 6, 7, 8]
    drafter.advance([[4, 5, 6, 7, 8]])
    assert drafter.candidates([2])[0].tokens == [20, 21]
    assert drafter.indexes[0].find(drafter.texts[0])[0] == 19  # where a fresh lookup would have gone: 30


def test_a_long_run_of_foretold_tokens_is_its_own_kind_of_proposal():
    drafter = LookupDrafter()
    drafter.add(list(range(100, 140)) + [100])  # the answer has begun copying the first 40 tokens
    for i in range(1, 20):
        (candidate,) = drafter.candidates([1])
        assert candidate.bucket[0] == ("run" if i > 16 else candidate.bucket[0])
        drafter.advance([[100 + i]])
    assert drafter.runs == [19] and drafter.candidates([1])[0].bucket == ("run", 16)
    drafter.advance([[7]])  # a departure ends the run
    assert drafter.runs == [0]


def test_the_suffix_cache_proposes_the_most_frequent_continuation_with_its_frequency():
    cache = SuffixCache()
    for text in ([1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 5]):
        cache.finish(cache.open(text), 0)
    tokens, n, frequency = cache.continuation([9, 1, 2], cap=4)
    assert (tokens, n) == ([3, 4], 2) and frequency == pytest.approx(2 / 3)


def test_a_finished_request_leaves_its_output_and_forgets_its_prompt():
    cache = SuffixCache()
    drafter = SuffixDrafter(cache)
    drafter.add([11, 12, 13, 14])
    drafter.advance([[21, 22, 23]])
    drafter.select([])  # the request finished
    assert cache.continuation([11, 12], cap=3) is None  # the prompt is gone
    assert cache.continuation([21], cap=3)[0] == [22, 23]  # the output stays for later requests
    assert cache.held == 3


def test_the_suffix_cache_holds_at_most_its_budget_of_finished_text():
    cache = SuffixCache(max_tokens=50)
    for i in range(20):
        cache.finish(cache.open([100 + i] * 3 + list(range(i, i + 7))), 0)
    assert cache.held <= 50 and len(cache.texts) == 5
    remembered = {place for places in cache.occurrences.values() for place in places}
    assert {text for text, _ in remembered} == set(cache.texts)  # nothing indexed of a forgotten text


FILE = list(range(100, 140))  # a prediction: 40 distinct tokens


@pytest.mark.parametrize(("answer", "place"), [
    (FILE[:10], 10),  # following it
    (FILE[:10] + [7, 8, 9] + FILE[10:15], 15),  # an inserted line, then the file again
    (FILE[:10] + FILE[20:25], 25),  # a deleted stretch
    (FILE[:10] + [7] + FILE[11:16], 16),  # a changed token
    (FILE[:10] + [7, 8], None),  # something new: nothing to propose
])
def test_a_prediction_keeps_its_place_through_inserts_deletes_and_changes(answer, place):
    prediction = Prediction(FILE)
    prediction.follow(answer)
    assert prediction.place == place


def test_a_lost_prediction_looks_forward_from_where_it_last_was_sure():
    text = [1, 2, 3, 4, 5, 9, 6, 7, 8, 1, 2, 3, 4, 5, 9, 6]  # "5 9" twice
    prediction = Prediction(text)
    prediction.follow(text[:12] + [0, 5, 9])  # past the first "5 9", a change, then "5 9"
    assert prediction.place == 15  # the second one's continuation, not the first's


def test_the_prediction_drafter_proposes_from_its_place_and_nothing_without_one():
    drafter = PredictionDrafter()
    drafter.add([1, 2], FILE)
    drafter.add([3, 4])
    first, none = drafter.candidates([4, 4])
    assert first.tokens == FILE[:4] and none is None
    drafter.advance([FILE[:3], [5]])
    assert drafter.candidates([4, 4])[0].tokens == FILE[3:7]


def test_prediction_tokens_are_counted_as_openai_counts_them():
    assert prediction_tokens(FILE, FILE) == (40, 0)
    assert prediction_tokens(FILE, FILE[:10] + [7, 8] + FILE[20:]) == (30, 10)


def test_greedy_exact_with_a_prediction_writes_the_targets_text_and_drafts_from_it(models):
    """Predicting the target's own answer with a change inside: lossless, and most of it in a few passes."""
    target, draft = models
    plain = decode(target, PROMPTS, verification=Verification("plain"), sampling=GREEDY, max_new_tokens=40)
    predictions = [t[:15] + [7, 7] + t[17:] for t in plain.tokens]
    for drafter, schedule in (("auto", Drafting(2, "speed", maximum=32)), ("prediction", Drafting(16))):
        out = decode(target, PROMPTS, draft=draft, drafter=drafter, verification=Verification("exact"), sampling=GREEDY,
                     drafting=schedule, max_new_tokens=40, predictions=predictions)
        assert out.tokens == plain.tokens
        for stats in out.stats:  # the auto schedule's choices follow measured times: only that it drafted
            assert stats.drafters["prediction"][1] >= (20 if drafter == "prediction" else 1)
            assert stats.target_forwards <= 12 or drafter == "auto"


def test_acceptance_learns_from_what_the_row_wrote_whether_or_not_it_was_drafted():
    estimate = Acceptance((0.0, 0.0), decay=1.0)
    assert estimate.observe(("b",), [5, 6, 7], [5, 6, 9]) == 2  # two kept, then a rejection
    assert estimate.observe(("b",), [5, 6], [5]) == 1  # a step of the target alone: one matched, no verdict after
    assert estimate.rate(("b",)) == pytest.approx(3 / 4)


def test_long_runs_start_from_their_own_prior_and_a_prediction_has_its_own():
    estimate = Acceptance((1.0, 3.0), run_prior=(9.0, 1.0))
    assert estimate.rate(("short",)) == 0.25 and estimate.rate(("run", 16)) == 0.9
    assert LookupDrafter().acceptance.rate(("run", 64)) == pytest.approx(RUN_PRIOR[0] / sum(RUN_PRIOR))
    rate = PredictionDrafter().acceptance.rate
    assert rate(("run", 64)) == pytest.approx(PREDICTION_RUN_PRIOR[0] / sum(PREDICTION_RUN_PRIOR))
    assert rate((1, "none")) == pytest.approx(PREDICTION_PRIOR[0] / sum(PREDICTION_PRIOR))


@pytest.mark.parametrize("drafter", DRAFTERS)
@pytest.mark.parametrize("schedule", [Drafting(4), Drafting(2, "speed", maximum=6)])
def test_greedy_exact_with_every_drafter_writes_what_the_target_alone_writes(models, drafter, schedule):
    target, draft = models
    plain = decode(target, PROMPTS, verification=Verification("plain"), sampling=GREEDY, max_new_tokens=30)
    spec = decode(target, PROMPTS, draft=draft, drafter=drafter, verification=Verification("exact"), sampling=GREEDY,
                  drafting=schedule, max_new_tokens=30)
    assert spec.tokens == plain.tokens
    for s in spec.stats:
        assert s.rule_tokens + s.target_tokens == s.new_tokens
        assert sum(d for d, _ in s.drafters.values()) == s.drafted
        assert set(s.drafters) <= {"model", "lookup", "suffix"}


def test_copying_drafters_cost_no_draft_forward_and_their_drafts_are_named(models):
    target, _ = models
    out = decode(target, PROMPTS, drafter="lookup", verification=Verification("exact"), sampling=GREEDY,
                 drafting=Drafting(4), max_new_tokens=30)
    assert all(s.draft_forwards == 0 for s in out.stats)
    assert sum(s.drafted for s in out.stats) > 0 and all(set(s.drafters) <= {"lookup"} for s in out.stats)


def test_a_repeated_request_is_proposed_from_the_earlier_answer_in_the_shared_cache(models):
    """A server's second request that repeats an earlier answer: the suffix cache proposes it, and greedy exact
    keeps most of it, in far fewer target passes than the first request took."""
    target, _ = models
    cache = SuffixCache()
    prompt = [4, 8, 15, 16, 23, 42]
    runs = [decode(target, [prompt], drafter="suffix", cache=cache, verification=Verification("exact"), sampling=GREEDY,
                   drafting=Drafting(8), max_new_tokens=40).stats[0] for _ in range(2)]
    first, second = runs
    assert second.drafters["suffix"][0] >= 30 and second.accepted / second.drafted > 0.8
    assert second.target_forwards < first.target_forwards / 3


@pytest.mark.parametrize("drafter", ["lookup", "prediction", "auto"])
def test_a_target_only_lenience_head_verifies_copied_drafts(models, drafter):
    """A head that reads the target alone needs no draft model: it verifies lookup's and a prediction's drafts,
    through the loop (only a mixture head is refused there)."""
    target, _ = models
    head = build(HeadConfig(8, 64, kind="lenience-target", initial_lenience=0.5))
    plain = decode(target, PROMPTS[:2], verification=Verification("plain"), sampling=GREEDY, max_new_tokens=24)
    out = decode(target, PROMPTS[:2], drafter=drafter, verification=Verification("diversed"), head=head,
                 sampling=GREEDY, drafting=Drafting(4), max_new_tokens=24, predictions=plain.tokens)
    assert all(s.drafted > 0 for s in out.stats)  # a mixture head is refused there: tests/test_one_request.py


def test_a_row_that_allows_one_drafter_gets_drafts_from_it_only(models):
    target, draft = models
    batch = Batch(target, make_drafter("auto", draft, capacity=2), drafting=Drafting(4), capacity=2)
    jobs = [Job(list(p), Policy(Verification("exact"), GREEDY, drafter=name), 24) for p, name in
            zip(PROMPTS, ["lookup", "model"], strict=False)]
    for job in jobs:
        batch.add(job)
    while batch.jobs:
        batch.step()
    assert set(jobs[0].stats.drafters) <= {"lookup"} and set(jobs[1].stats.drafters) <= {"model"}


# A point mass q = one-hot(x) under each rule's closed form (test_verify's "one-hot-q" cases check what the
# output follows).
P = torch.tensor([0.5, 0.25, 0.15, 0.1])
X = 1  # the drafted token


@pytest.mark.parametrize(("verification", "acceptance"), [
    (Verification("exact"), P[X]),
    (Verification("static", weight=0.6), 0.6 * P[X] + 0.4),
    (Verification("lossy", lenience=0.5), min(1.0, P[X] / 0.5)),
])
def test_a_point_mass_draft_is_accepted_with_the_rules_closed_form(verification, acceptance):
    q = torch.nn.functional.one_hot(torch.tensor(X), 4).float()
    got = acceptance_probability(verification.rule, P, q, **verification.verify_params())
    assert float(got) == pytest.approx(float(acceptance))

"""The decoding loop on tiny randomly initialised models, in float32."""

import math

import pytest
import torch
from closed_forms import first_two_token_marginals

from diversed.decoding.engine import decode
from diversed.decoding.profile import PHASES
from diversed.request import Drafting, Sampling, Verification
from diversed.verify import verify

from tiny import perturbed, tiny_model

VOCAB = 97
GREEDY = Sampling(temperature=0)
PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15, 16], [40]]


@pytest.fixture(scope="module")
def target():
    return tiny_model(0, layers=3)


@pytest.fixture(scope="module", params=["close", "unrelated"])
def draft(request, target):
    return perturbed(target, 0.05, 1) if request.param == "close" else tiny_model(5, layers=2, hidden=32)


@pytest.fixture
def requested(monkeypatch) -> list[int]:
    """The draft length the loop asks for in each round, in order."""
    from diversed.decoding.drafters import ModelDrafter

    lengths = []
    original = ModelDrafter._draft

    def spy(drafter, tokens, caps, ask):
        lengths.append(max(caps))
        return original(drafter, tokens, caps, ask)

    monkeypatch.setattr(ModelDrafter, "_draft", spy)
    return lengths


@pytest.mark.parametrize("n", [1, 3, 5])
@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_exact_equals_plain_target_decoding(target, draft, n, batch):
    prompts = PROMPTS[:batch]
    plain = decode(target, prompts, verification=Verification("plain"), sampling=GREEDY, max_new_tokens=24)
    spec = decode(target, prompts, draft=draft, verification=Verification("exact"), sampling=GREEDY,
                  drafting=Drafting(n), max_new_tokens=24)
    assert spec.tokens == plain.tokens
    assert all(len(t) == 24 for t in spec.tokens)


def test_close_draft_is_accepted_often_and_unrelated_rarely(target):
    close = decode(target, PROMPTS, draft=perturbed(target, 0.05, 1), sampling=GREEDY, max_new_tokens=24)
    far = decode(target, PROMPTS, draft=tiny_model(5, hidden=32), sampling=GREEDY, max_new_tokens=24)
    assert close.summary()["acceptance_rate"] > 0.5 > far.summary()["acceptance_rate"]


@pytest.mark.parametrize("verification", [Verification("exact"), Verification("static", weight=0.5),
                                          Verification("cascade-opt", alpha=0.3)])
def test_batch_equals_one_by_one(target, draft, verification):
    together = decode(target, PROMPTS, draft=draft, verification=verification, sampling=GREEDY, max_new_tokens=20)
    for prompt, tokens in zip(PROMPTS, together.tokens, strict=True):
        alone = decode(target, [prompt], draft=draft, verification=verification, sampling=GREEDY, max_new_tokens=20)
        assert alone.tokens[0] == tokens


@pytest.mark.parametrize("schedule", [Drafting(2, "heuristic"), Drafting(4, confidence=0.3),
                                      Drafting(3, "heuristic", confidence=0.5)])
def test_schedules_and_confidence_stop_stay_exact(target, draft, schedule):
    plain = decode(target, PROMPTS, verification=Verification("plain"), sampling=GREEDY, max_new_tokens=24)
    spec = decode(target, PROMPTS, draft=draft, sampling=GREEDY, drafting=schedule, max_new_tokens=24)
    assert spec.tokens == plain.tokens


def test_static_weight_one_equals_exact_when_sampling(target, draft):
    kwargs = dict(draft=draft, sampling=Sampling(1.0), max_new_tokens=20, seed=11)
    exact = decode(target, PROMPTS, verification=Verification("exact"), **kwargs)
    static = decode(target, PROMPTS, verification=Verification("static", weight=1.0), **kwargs)
    ones = decode(target, PROMPTS, verification=Verification("dynamic"),
                  head=lambda hd, ht: torch.ones(hd.shape[:2]), **kwargs)
    assert exact.tokens == static.tokens == ones.tokens


def test_a_heads_shift_moves_its_logit(target, draft):
    """diversed:HEAD@S runs the head's w as sigmoid(logit(w) + S): a flat head at 0.5 shifted by log 3 is the
    static ensemble at 0.75, and any head shifted is the same head with the shift written into it."""
    kwargs = dict(draft=draft, sampling=Sampling(1.0), max_new_tokens=20, seed=5)
    half = decode(target, PROMPTS, verification=Verification("diversed", shift=math.log(3)), **kwargs,
                  head=lambda hd, ht: torch.full(hd.shape[:2], 0.5))
    assert half.tokens == decode(target, PROMPTS, verification=Verification("static", weight=0.75), **kwargs).tokens

    def head(h_draft, h_target):
        return torch.sigmoid(h_draft[..., 0] - h_target[..., 1])

    shifted = decode(target, PROMPTS, verification=Verification("diversed", shift=-1.5), head=head, **kwargs)
    written = decode(target, PROMPTS, verification=Verification("diversed"), **kwargs,
                     head=lambda hd, ht: torch.sigmoid(torch.logit(head(hd, ht)) - 1.5))
    unshifted = decode(target, PROMPTS, verification=Verification("diversed"), head=head, **kwargs)
    assert shifted.tokens == written.tokens != unshifted.tokens


def test_same_seed_same_tokens_other_seed_other_tokens(target, draft):
    kwargs = dict(draft=draft, verification=Verification("static", weight=0.5),
                  sampling=Sampling(1.0, top_k=20, top_p=0.9), max_new_tokens=20)
    a, b = decode(target, PROMPTS, seed=1, **kwargs), decode(target, PROMPTS, seed=1, **kwargs)
    c = decode(target, PROMPTS, seed=2, **kwargs)
    assert a.tokens == b.tokens != c.tokens


def test_weight_zero_accepts_every_draft(target, draft):
    out = decode(target, PROMPTS, draft=draft, verification=Verification("static", weight=0.0), sampling=Sampling(1.0),
                 drafting=Drafting(4), max_new_tokens=20)
    assert out.summary()["acceptance_rate"] == 1.0


def test_dynamic_weights_see_both_models_hidden_states(target, draft):
    seen = []

    def weight_fn(h_draft, h_target):
        seen.append((h_draft.shape, h_target.shape))
        return torch.full(h_draft.shape[:2], 0.5)

    decode(target, PROMPTS, draft=draft, verification=Verification("dynamic"), head=weight_fn,
           sampling=Sampling(1.0), drafting=Drafting(3), max_new_tokens=8)
    b, n, d_draft = seen[0][0]
    assert (b, n) == (len(PROMPTS), 3) and d_draft == draft.config.hidden_size
    assert seen[0][1] == (b, n, target.config.hidden_size)


def test_each_sequence_stops_at_its_own_eos(target, draft):
    plain = decode(target, PROMPTS, verification=Verification("plain"), sampling=GREEDY, max_new_tokens=24)
    eos = plain.tokens[0][5]  # a token the first sequence writes early
    out = decode(target, PROMPTS, draft=draft, sampling=GREEDY, max_new_tokens=24, eos_token_ids=[eos])
    for full, tokens, stats in zip(plain.tokens, out.tokens, out.stats, strict=True):
        expected = full[: full.index(eos) + 1] if eos in full else full
        assert tokens == expected
        assert stats.finish_reason == ("eos" if eos in full else "length")
        assert stats.new_tokens == len(tokens)


def test_stop_function_ends_a_sequence_at_the_token_that_completes_it(target, draft):
    plain = decode(target, PROMPTS, verification=Verification("plain"), sampling=GREEDY, max_new_tokens=24)
    out = decode(target, PROMPTS, draft=draft, sampling=GREEDY, drafting=Drafting(5), max_new_tokens=24,
                 stop=lambda t, start: max(start + 1, 3) if len(t) >= 3 else None)
    # A round that writes past the stop is cut back: the same tokens as the target alone, and counts to match.
    assert out.tokens == [full[:3] for full in plain.tokens]
    assert {s.finish_reason for s in out.stats} == {"stop"}
    assert [s.new_tokens for s in out.stats] == [3] * len(PROMPTS)


def test_metrics_add_up(target, draft):
    out = decode(target, PROMPTS, draft=draft, sampling=Sampling(1.0), drafting=Drafting(3),
                 max_new_tokens=30)
    for s in out.stats:
        d = s.to_dict()
        assert s.accepted <= s.drafted <= 3 * s.target_forwards  # the last rounds may draft fewer
        assert s.new_tokens <= s.accepted + s.target_forwards  # each round emits kept drafts + one token
        assert d["tau"] == s.new_tokens / s.target_forwards
        assert s.reached[0] == s.target_forwards  # every round drafts at least one token
    total = out.summary()
    assert total["drafted"] == sum(s.drafted for s in out.stats)
    assert total["acceptance_rate"] == total["accepted"] / total["drafted"]


def _first_tokens(model, batch: int, seed: int, **kwargs) -> torch.Tensor:
    out = decode(model, [[1, 2, 3]] * batch, max_new_tokens=2, seed=seed, **kwargs)
    return torch.tensor([t[:2] for t in out.tokens])


@pytest.mark.parametrize("drafting", [Drafting(2), Drafting(4, confidence=0.3)], ids=["constant", "cut-off"])
def test_exact_sampling_gives_the_target_distribution_end_to_end(drafting):
    """Over 20,000 sequences, the first two tokens of exact speculative sampling follow the target: the
    first token p(t1), the second its marginal sum_t1 p(t1) p(t2 | t1) (which goes through the bonus and
    correction paths of the loop). With the confidence cut-off, the rows of a round draft different numbers
    of tokens, and a row cut short takes its bonus token where its drafts end."""
    target, draft = tiny_model(0, vocab=12, hidden=32), tiny_model(3, vocab=12, hidden=32)
    target.lm_head.weight.data /= 4
    p1, p2 = first_two_token_marginals(target, [1, 2, 3])
    # 4 new tokens leave room for 3 drafts in the first round, so the cut-off (not the room) ends them.
    out = decode(target, [[1, 2, 3]] * 20000, draft=draft, verification=Verification("exact"), drafting=drafting,
                 max_new_tokens=4, seed=0)
    tokens = torch.tensor([t[:2] for t in out.tokens])
    if drafting.confidence:  # the case happens: some rows never drafted past 1 token, others reached 2
        assert {len(s.reached) for s in out.stats} >= {1, 2}
    for position, expected in ((0, p1), (1, p2)):
        empirical = torch.bincount(tokens[:, position], minlength=12) / len(tokens)
        assert 0.5 * (empirical - expected).abs().sum() < 0.02


def test_static_sampling_gives_the_mixture_end_to_end():
    target, draft = tiny_model(0, vocab=12, hidden=32), tiny_model(3, vocab=12, hidden=32)
    with torch.no_grad():
        p = torch.softmax(target(torch.tensor([[1, 2, 3]])).logits[0, -1], -1)
        q = torch.softmax(draft(torch.tensor([[1, 2, 3]])).logits[0, -1], -1)
    tokens = _first_tokens(target, 20000, 1, draft=draft, verification=Verification("static", weight=0.3),
                           drafting=Drafting(3))
    empirical = torch.bincount(tokens[:, 0], minlength=12) / len(tokens)
    assert 0.5 * (empirical - (0.3 * p + 0.7 * q)).abs().sum() < 0.02


def test_models_of_different_vocabularies_are_refused(target, draft):
    """decode() trusts its token ids (a request is checked where it is admitted: tests/test_one_request.py);
    the models it is given must still fit together."""
    with pytest.raises(ValueError, match="different vocabularies"):
        decode(target, PROMPTS, draft=tiny_model(1, vocab=50))


def test_both_caches_match_fresh_forwards_in_every_round(target, draft, monkeypatch):
    """Spy on the verifier: in every round, the draft's q_i and the target's p_i it receives must equal what
    fresh no-cache forwards over the emitted prefix and the drafts give. Greedy exactness alone cannot catch
    a wrong draft cache (the exact rule is lossless whatever the draft proposes); this can."""
    import diversed.decoding.policy as policy

    rounds = []

    def spy(rule, drafts, q, p, **kwargs):
        out = verify(rule, drafts, q, p, **kwargs)
        rounds.append((drafts.clone(), q.clone(), p.clone(), out))
        return out

    monkeypatch.setattr(policy, "verify", spy)
    prompt = [3, 1, 4, 1, 5]
    out = decode(target, [prompt], draft=draft, verification=Verification("static", weight=0.6), sampling=Sampling(1.0),
                 drafting=Drafting(3), max_new_tokens=30, seed=4)
    emitted = prompt
    for drafts, q, p, verdict in rounds:
        sequence = torch.tensor([emitted + drafts[0].tolist()])
        with torch.no_grad():
            fresh_q = torch.softmax(draft(sequence).logits[0, len(emitted) - 1:-1], -1)
            fresh_p = torch.softmax(target(sequence).logits[0, len(emitted) - 1:], -1)
        torch.testing.assert_close(q[0], fresh_q, atol=1e-4, rtol=1e-3)
        torch.testing.assert_close(p[0], fresh_p, atol=1e-4, rtol=1e-3)
        kept = int(verdict.num_accepted[0])
        emitted = emitted + drafts[0, :kept].tolist() + [int(verdict.next_token[0])]
    assert emitted[len(prompt):][: len(out.tokens[0])] == out.tokens[0] and len(rounds) > 5


def test_confidence_stops_do_not_shrink_the_requested_draft_length(target, requested):
    unsure_draft = tiny_model(5, hidden=32)  # random logits: every drafted token is below the cut-off
    out = decode(target, PROMPTS, draft=unsure_draft, sampling=GREEDY,
                 drafting=Drafting(5, confidence=0.9), max_new_tokens=10)
    assert all(s.drafted == s.target_forwards for s in out.stats)  # the cut-off stops each round after 1 draft
    # So a round writes at most 2 tokens, and the first three rounds are not cut by the tokens still needed.
    assert requested[:3] == [5, 5, 5] and max(requested) == 5


def test_bad_weights_and_unsupported_models_are_refused(target, draft):
    dynamic = dict(draft=draft, verification=Verification("dynamic"))
    with pytest.raises(ValueError, match="outside"):
        decode(target, PROMPTS, head=lambda hd, ht: 2 * torch.ones(hd.shape[:2]), **dynamic)
    with pytest.raises(ValueError, match="shape"):
        decode(target, PROMPTS, head=lambda hd, ht: torch.ones(hd.shape[0]), **dynamic)
    capped = tiny_model(0)
    capped.config.final_logit_softcapping = 30.0
    with pytest.raises(ValueError, match="soft-capping"):
        decode(capped, PROMPTS, verification=Verification("plain"))


def test_auto_schedule_stays_exact_and_changes_the_draft_length(target, requested):
    close = perturbed(target, 0.05, 1)
    plain = decode(target, PROMPTS, verification=Verification("plain"), sampling=GREEDY, max_new_tokens=30)
    spec = decode(target, PROMPTS, draft=close, sampling=GREEDY, drafting=Drafting(2, "speed"),
                  max_new_tokens=30)
    assert spec.tokens == plain.tokens
    # The first round drafts the length asked for; then the speed model chooses: other lengths, or rounds of
    # the target alone (these tiny draft and target cost about the same per step).
    drafted_rounds = len(requested)
    assert requested[0] == 2 and max(requested) <= 16
    assert len(set(requested)) > 1 or drafted_rounds < max(s.target_forwards for s in spec.stats)


@pytest.mark.parametrize("verification", [Verification("plain"), Verification("exact"), Verification("dynamic")])
def test_profile_splits_the_wall_time_into_phases(target, draft, verification):
    out = decode(target, PROMPTS, draft=draft, verification=verification, sampling=Sampling(1.0), max_new_tokens=12,
                 head=lambda hd, ht: torch.full(hd.shape[:2], 0.5), profile=True)
    profile = out.profile
    assert all(profile[phase] >= 0 for phase in PHASES)
    assert sum(profile[phase] for phase in PHASES) == pytest.approx(profile["total"])
    assert profile["total"] <= out.wall_time + 1e-3 and profile["target forward"] > 0
    assert profile["rounds"] == max(s.target_forwards for s in out.stats)
    assert (profile["draft"] > 0) == (verification.name != "plain")
    assert (profile["head"] > 0) == (verification.name == "dynamic")


def test_rounds_draft_no_more_than_the_tokens_still_needed(target, draft, requested):
    out = decode(target, PROMPTS[:1], draft=draft, sampling=GREEDY, drafting=Drafting(10), max_new_tokens=7)
    assert len(out.tokens[0]) == 7 and requested[0] == 6 and all(n <= 6 for n in requested)
    assert out.stats[0].accepted <= 6 and out.stats[0].drafted == sum(requested)

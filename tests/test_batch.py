"""Continuous batching (diversed.decoding.engine.Batch): jobs that join a running batch, rows with different
policies, cancellation, streaming callbacks, and one policy's failure, on tiny models."""

from __future__ import annotations

import pytest
import torch

from diversed.backends import as_model
from diversed.decoding.drafters import make_drafter
from diversed.decoding.engine import Batch, Job, decode
from diversed.decoding.policy import Policy
from diversed.models.quantize import quantize_linears
from diversed.request import Drafting, Sampling, Verification

from tiny import perturbed, tiny_model

GREEDY = Sampling(0)
PROMPTS = [[3, 1, 4, 1, 5], [9, 2, 6], [5, 3, 5, 8, 9, 7, 9], [2, 7], [8, 8, 4, 6], [6, 2, 8, 3]]
VERIFICATIONS = [Verification("exact"), Verification("static", weight=0.4), Verification("lossy", lenience=0.5),
                 Verification("plain"), Verification("cascade-opt", alpha=0.2), Verification("typical")]


@pytest.fixture(scope="module")
def models():
    target = tiny_model(0)
    return as_model(target), as_model(perturbed(target, 0.05, 1))


def alone(models, prompt, verification, max_new_tokens=20, drafting=Drafting(3)) -> list[int]:
    target, draft = models
    return decode(target, [prompt], draft=draft, verification=verification, sampling=GREEDY, drafting=drafting,
                  max_new_tokens=max_new_tokens).tokens[0]


def job(prompt, verification, max_new_tokens=20, **policy) -> Job:
    return Job(list(prompt), Policy(verification, GREEDY, torch.Generator().manual_seed(0), **policy), max_new_tokens)


def test_jobs_joining_a_running_batch_with_their_own_rules_write_what_they_write_alone(models):
    target, draft = models
    batch = Batch(target, make_drafter("model", draft, capacity=4), drafting=Drafting(3), capacity=4)
    jobs = [job(p, m, max_new_tokens=12 + 3 * i) for i, (p, m) in enumerate(zip(PROMPTS, VERIFICATIONS, strict=True))]
    waiting, rounds = list(jobs), 0
    while waiting or batch.jobs:
        if waiting and rounds % 3 == 0 and len(batch.jobs) < batch.capacity:  # a job joins every third round
            batch.add(waiting.pop(0))
        batch.step()
        rounds += 1
    for j in jobs:
        assert j.finished and j.tokens == alone(models, j.prompt, j.policy.verification, j.max_new_tokens)


def test_a_cancelled_job_leaves_and_the_others_are_unchanged(models):
    target, draft = models
    batch = Batch(target, make_drafter("model", draft, capacity=3), drafting=Drafting(3), capacity=3)
    jobs = [job(p, Verification("static", weight=0.6), max_new_tokens=30) for p in PROMPTS[:3]]
    for j in jobs:
        batch.add(j)
    batch.step()
    jobs[1].cancelled = True
    left = batch.step()
    assert jobs[1] in left and jobs[1].stats.finish_reason == "cancelled" and len(batch.jobs) == 2
    while batch.jobs:
        batch.step()
    for j in (jobs[0], jobs[2]):
        assert j.tokens == alone(models, j.prompt, Verification("static", weight=0.6), 30)


def test_streamed_tokens_join_into_the_jobs_tokens(models):
    target, draft = models
    seen: dict[int, list[int]] = {0: [], 1: []}
    out = decode(target, PROMPTS[:2], draft=draft, verification=Verification("exact"), sampling=Sampling(1.0),
                 drafting=Drafting(4), max_new_tokens=25, seed=3,
                 on_tokens=lambda i, new: seen[i].extend(new))
    assert [seen[0], seen[1]] == out.tokens


def test_a_failing_policy_fails_only_its_own_rows(models):
    target, draft = models

    def broken(h_draft, h_target):
        raise RuntimeError("broken head")

    batch = Batch(target, make_drafter("model", draft, capacity=3), drafting=Drafting(3), capacity=3)
    jobs = [job(PROMPTS[0], Verification("exact")), job(PROMPTS[1], Verification("diversed"), head=broken),
            job(PROMPTS[2], Verification("static", weight=0.5))]
    for j in jobs:
        batch.add(j)
    while batch.jobs:
        batch.step()
    assert jobs[1].stats.finish_reason == "error" and "broken head" in jobs[1].error and not jobs[1].tokens
    assert jobs[0].tokens == alone(models, PROMPTS[0], Verification("exact"))
    assert jobs[2].tokens == alone(models, PROMPTS[2], Verification("static", weight=0.5))
    alone_batch = Batch(target, make_drafter("model", draft, capacity=1), drafting=Drafting(3), capacity=1)
    alone_batch.add(job(PROMPTS[1], Verification("diversed"), head=broken))
    with pytest.raises(RuntimeError, match="broken head"):  # a batch of one policy raises, as decode() does
        alone_batch.step()


def test_a_policys_draft_cap_limits_its_rows_drafts_only(models):
    target, draft = models
    batch = Batch(target, make_drafter("model", draft, capacity=2), drafting=Drafting(4), capacity=2)
    capped, free = job(PROMPTS[0], Verification("exact"), max_drafts=1), job(PROMPTS[1], Verification("exact"))
    batch.add(capped)
    batch.add(free)
    while batch.jobs:
        batch.step()
    assert len(capped.stats.reached) == 1 and len(free.stats.reached) == 4
    assert capped.tokens == alone(models, PROMPTS[0], Verification("exact"))


def test_a_full_batch_is_refused(models):
    """A job is admitted before it reaches a batch (diversed.admission; tests/test_one_request.py): a batch
    refuses only what it has no room for."""
    target, _ = models
    batch = Batch(target, None, capacity=1)
    batch.add(job(PROMPTS[0], Verification("plain")))
    with pytest.raises(RuntimeError, match="full"):
        batch.add(job(PROMPTS[1], Verification("plain")))


def test_the_heuristic_schedule_reads_only_the_rows_that_drafted():
    """Rows of the target alone in a speculative round draft nothing: they are no verdict on the length."""
    target = tiny_model(0)
    batch = Batch(as_model(target), make_drafter("model", as_model(tiny_model(5, layers=2, hidden=32)), capacity=3),
                  drafting=Drafting(3, "heuristic"), capacity=3)
    verifications = [Verification("exact"), Verification("plain"), Verification("plain")]
    jobs = [job(p, m) for p, m in zip(PROMPTS[:3], verifications, strict=True)]
    for j in jobs:
        batch.add(j)
    batch.step()
    drafting = jobs[0].stats
    assert drafting.drafted == 3 and drafting.accepted < 3  # an unrelated draft: rejected in the round
    assert batch.scheduler.n == 2  # one round shorter, as for this row alone (two kept-everything rows of 0 said +2)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_with_an_int8_draft_a_request_writes_the_same_alone_in_a_mixed_batch_and_after_traffic(temperature):
    """The default CPU draft precision: each row's activations have their own int8 scale, so a request's
    tokens and counts do not depend on what is decoded with it or before it (rules that read q included)."""
    tiny = tiny_model(0)
    target, draft = as_model(tiny), as_model(quantize_linears(perturbed(tiny, 0.05, 1), "int8"))
    rules = [Verification("exact"), Verification("static", weight=0.5), Verification("lossy", lenience=0.3)]
    requests = [(prompt, rules[i % 3]) for i, prompt in enumerate(PROMPTS)]

    def run(wanted: list[int], traffic: bool = False) -> dict[int, tuple]:
        batch = Batch(target, make_drafter("model", draft, capacity=len(PROMPTS)), drafting=Drafting(3),
                      capacity=len(PROMPTS))
        if traffic:  # other requests first, to the end
            for prompt in PROMPTS[::-1][:3]:
                batch.add(Job(prompt[::-1], Policy(Verification("static", weight=0.2), Sampling(temperature),
                                                   torch.Generator().manual_seed(99)), 9))
            while batch.jobs:
                batch.step()
        jobs = {i: Job(list(requests[i][0]), Policy(requests[i][1], Sampling(temperature),
                                                    torch.Generator().manual_seed(10 + i)), 14) for i in wanted}
        for j in jobs.values():
            batch.add(j)
        while batch.jobs:
            batch.step()
        return {i: (j.tokens, j.stats.drafted, j.stats.accepted) for i, j in jobs.items()}

    solo = {i: run([i])[i] for i in range(len(requests))}
    assert run(list(range(len(requests)))) == solo
    assert run(list(range(len(requests))), traffic=True) == solo
    assert any(accepted for _, _, accepted in solo.values())


def _company_runs(models, drafter: str, temperature: float) -> tuple[tuple, tuple]:
    """One request (lossy:0.5, seeded) alone and beside one with a prediction and another rule, on one drafter."""
    target, draft = models

    def run(company: bool) -> tuple:
        batch = Batch(target, make_drafter(drafter, draft, capacity=2), drafting=Drafting(3), capacity=2)
        mine = Job([3, 1, 4, 1, 5, 3, 1, 4], Policy(Verification("lossy", lenience=0.5), Sampling(temperature),
                                                    torch.Generator().manual_seed(7)), 24)
        batch.add(mine)
        if company:
            batch.add(Job([9, 2, 6], Policy(Verification("static", weight=0.3), Sampling(temperature),
                                            torch.Generator().manual_seed(8)), 24, prediction=list(range(5, 29))))
        while batch.jobs:
            batch.step()
        return mine.tokens, mine.stats.drafted, mine.stats.accepted, dict(mine.stats.drafters)

    return run(False), run(True)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("drafter", ["model", "lookup", "prediction", "auto"])
def test_with_a_fixed_length_a_request_writes_the_same_whatever_its_company(models, drafter, temperature):
    """Beside a request with a prediction and another rule, on a fixed draft length: the auto drafter chooses
    each row's drafter by that row alone (the draft model for this one)."""
    alone_run, in_company = _company_runs(models, drafter, temperature)
    assert alone_run == in_company
    if drafter == "auto":
        assert set(alone_run[3]) == {"model"}


def test_a_row_that_may_only_copy_copies_beside_rows_of_the_draft_model(models):
    """A request limited to lookup, in a batch whose other row drafts with the draft model, gets its copies
    (beside the model's drafts in one round) and writes what it writes alone."""
    target, draft = models
    prompt = [3, 1, 4, 1, 5, 3, 1, 4, 1, 5]

    def run(company: bool) -> Job:
        batch = Batch(target, make_drafter("auto", draft, capacity=2), drafting=Drafting(3), capacity=2)
        mine = Job(prompt, Policy(Verification("lossy", lenience=0.5), Sampling(1.0), torch.Generator().manual_seed(3),
                                  drafter="lookup"), 24)
        batch.add(mine)
        if company:
            batch.add(job([9, 2, 6], Verification("static", weight=0.3), 24))
        while batch.jobs:
            batch.step()
        return mine

    alone_run, in_company = run(False), run(True)
    assert set(in_company.stats.drafters) == {"lookup"} and in_company.stats.drafted > 0
    assert (alone_run.tokens, alone_run.stats.accepted) == (in_company.tokens, in_company.stats.accepted)

"""The decoding loop: plain target decoding, and speculative decoding with any drafter and verification rule.

A Batch holds the target's rows (diversed.backends: the loop only feeds tokens, reads logits, truncates,
selects and adds rows), a drafter (diversed.decoding.drafters: the draft model, or text copied from the
prompt, the output and earlier requests) and one Job per row; jobs join between rounds and leave when
finished or cancelled (continuous batching), and each follows its own Policy (diversed.decoding.policy).
`decode` is a batch whose jobs all join at the start. One round of speculative decoding:
  1. the drafter proposes up to N tokens per row, with their distribution q or as point masses;
  2. the target scores the N+1 positions in one forward;
  3. the verifier (diversed.verify) keeps a prefix and picks the next token;
  4. the target rolls back to the kept tokens, and the drafter is told what each row wrote.
Invariant between rounds: the target has seen every token but the last emitted one. A job's prompt is
unseen when it joins: its prefill is its first round's forward.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from diversed.backends import Model, as_model
from diversed.decoding.drafters import Drafter, DraftRound, Proposal, SuffixCache, make_drafter
from diversed.decoding.metrics import SequenceStats, summarize
from diversed.decoding.policy import Groups, Head, Policy
from diversed.decoding.profile import PhaseClock
from diversed.decoding.provenance import TokenOrigin, round_origins, target_origin
from diversed.decoding.schedule import CostMemory, stopwatch
from diversed.decoding.scheduler import Scheduler
from diversed.request import Drafting, Sampling, Verification, as_drafting, renamed_keywords
from diversed.verify import Verdict

# (the new tokens of a sequence so far, where this round's began) -> how many of them hold the first stop
# string (the round's token that completed it included), or None: a stop string never appeared.
StopFn = Callable[[list[int], int], int | None]


@dataclass
class Generation:
    """The new tokens of each prompt, per-sequence statistics, and the totals of the run. profile: seconds per
    phase of the rounds (diversed.decoding.profile); origins: how each token was made (with provenance=True;
    else empty lists)."""

    tokens: list[list[int]]
    stats: list[SequenceStats]
    wall_time: float
    profile: dict[str, float]
    origins: list[list[TokenOrigin]]

    def summary(self) -> dict:
        return summarize(self.stats, self.wall_time)


@renamed_keywords(method="verification", weight_fn="head")
@torch.inference_mode()
def decode(
    target: Model | torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    *,
    draft: Model | torch.nn.Module | None = None,
    drafter: str | Drafter | None = None,
    cache: SuffixCache | None = None,
    verification: Verification = Verification("exact"),
    sampling: Sampling = Sampling(),
    draft_length: int | None = None,
    drafting: Drafting | None = None,
    max_new_tokens: int = 128,
    eos_token_ids: Sequence[int] = (),
    stop: StopFn | None = None,
    head: Head | None = None,
    seed: int = 0,
    profile: bool = False,
    on_tokens: Callable[[int, list[int]], None] | None = None,
    on_round: Callable[[int, Round | None, int, int], None] | None = None,
    predictions: Sequence[Sequence[int] | None] | None = None,
    provenance: bool = False,
    costs: CostMemory | None = None,
    cache_prompt: bool = True,
) -> Generation:
    """Generate up to max_new_tokens after each prompt (token ids) with `verification`: the decoding loop for
    callers that hold token ids and models (a trainer, a benchmark). It trusts its arguments: a request is
    checked where it is admitted (diversed.admission), and generate() is the way in from text.

    target, draft: backend models (diversed.backends) or transformers models. drafter: one of
    diversed.request.DRAFTERS, or a Drafter; default: "model" with a draft, else none. cache: the suffix cache
    the "suffix" and "auto" drafters share (default: a new one). Verification "plain" decodes with the target
    alone; every other one needs a drafter, and "diversed"/"dynamic" a head (diversed.decoding.policy.Head).
    A sequence stops at any of eos_token_ids (kept in its tokens), where stop (a StopFn) finds a stop string, or
    at max_new_tokens. Seeded, the same inputs give the same tokens, except under the "speed" schedule, whose
    draft lengths follow the clock; greedy "exact" and "plain" always do. profile=True makes the per-phase times
    of Generation.profile exact on a GPU (by waiting for the device around each phase).
    draft_length: N drafts every round; drafting: a Drafting (default: Drafting()), not both.
    on_tokens(i, new): called with each round's new tokens of prompt i, as they come (streaming).
    on_round(i, round, row, count): called after each round with prompt i's row in the Round (what the
    verifier saw; None for a step of the target alone) and how many tokens it emitted (a trainer's capture:
    diversed.head.train).
    predictions: per prompt, the token ids its answer is expected to repeat, or None (Predicted Outputs: the
    "prediction" and "auto" drafters draft from them).
    provenance: record how each token was made (Generation.origins; diversed.decoding.provenance).
    costs: the speed schedule's measured costs to start from and add to (None: this call's own).
    cache_prompt: start each prompt from what the models' prompt caches hold of it (diversed.backends); False:
    read every prompt whole, so that the tokens cannot depend on what the process read before.
    """
    target = as_model(target)
    draft = None if draft is None else as_model(draft)
    drafting = as_drafting(draft_length, drafting) or Drafting()
    if draft is not None and draft.vocab_size != target.vocab_size:  # the models' own mismatch, no request's
        raise ValueError(f"draft and target have different vocabularies ({draft.vocab_size} vs {target.vocab_size} "
                         "logits)")
    if verification.name == "plain":
        drafter = None
    elif isinstance(drafter, str) or (drafter is None and draft is not None):
        drafter = make_drafter(drafter or "model", draft, capacity=len(prompts), confidence=drafting.confidence,
                               cache=cache)
    policy = Policy(verification, sampling, torch.Generator(device=target.device).manual_seed(seed), head)
    batch = Batch(target, drafter, drafting=drafting, eos_token_ids=eos_token_ids, capacity=len(prompts),
                  profile=profile, costs=costs)
    predictions = predictions or [None] * len(prompts)
    jobs = [Job(list(p), policy, max_new_tokens, stop,
                None if on_tokens is None else lambda job, new, i=i: on_tokens(i, new),
                None if on_round is None else lambda job, result, row, count, i=i: on_round(i, result, row, count),
                prediction=None if prediction is None else list(prediction), provenance=provenance,
                cache_prompt=cache_prompt)
            for i, (p, prediction) in enumerate(zip(prompts, predictions, strict=True))]
    for job in jobs:
        batch.add(job)
    while batch.jobs:
        batch.step()
    batch.close()
    return batch.generation(jobs)


@dataclass(eq=False)
class Job:
    """One sequence of a batch: its prompt (token ids), how it is decoded, where it stops, and what it wrote.

    on_tokens(job, new) is called from the decoding loop with each round's new tokens (cut at EOS, the
    length limit or a stop string) and once more with [] if the job ends without new tokens (cancelled, or
    failed: `error` says why); job.stats.finish_reason says whether it is done ("eos", "stop", "length",
    "cancelled" or "error"). on_round(job, round, row, count) is called after each round with the job's row of
    the Round (None for a step of the target alone) and the tokens it emitted (what a trainer keeps). Set
    `cancelled` from any thread: the job leaves the batch before the next round. prediction: the token ids the
    answer is expected to repeat (Predicted Outputs), for the drafter. provenance: keep `origins`, how each
    token was made (diversed.decoding.provenance), one per token, in step with `tokens` (on_tokens sees them).
    cache_prompt: start from the longest prefix of the prompt that the target's (and the draft model's) prompt
    cache holds (diversed.backends: `Rows.reuse`; stats.cached_tokens counts the target's), reading only the
    rest."""

    prompt: list[int]
    policy: Policy = field(default_factory=Policy)
    max_new_tokens: int = 128
    stop: StopFn | None = None
    on_tokens: Callable[[Job, list[int]], None] | None = None
    on_round: Callable[[Job, Round | None, int, int], None] | None = None
    cancelled: bool = False
    error: str = ""
    prediction: list[int] | None = None
    provenance: bool = False
    cache_prompt: bool = True
    tokens: list[int] = field(default_factory=list)
    origins: list[TokenOrigin] = field(default_factory=list)
    stats: SequenceStats = field(default_factory=SequenceStats)
    started: float = 0.0

    @property
    def finished(self) -> bool:
        return bool(self.stats.finish_reason)

    def end(self, reason: str, error: str = "") -> None:
        """Finish without new tokens: cancelled, or failed with `error`."""
        self.stats.finish_reason, self.error = reason, error
        self.stats.wall_time = time.perf_counter() - self.started
        if self.on_tokens is not None:
            self.on_tokens(self, [])

    def emit(self, new: list[int], eos: set[int], kept: int = 0, drafted: int = 0,
             origins: list[TokenOrigin] | None = None) -> bool:
        """Append a round's new tokens (its `kept` drafts of `drafted`, then the next token) and, with
        provenance, their origins, cut at EOS, the length limit or a stop string; True if the job is finished."""
        added = []
        for token in new:
            added.append(token)
            if token in eos:
                self.stats.finish_reason = "eos"
                break
            if len(self.tokens) + len(added) >= self.max_new_tokens:
                self.stats.finish_reason = "length"
                break
        self.tokens += added
        start = len(self.tokens) - len(added)
        if not self.finished and self.stop is not None and (end := self.stop(self.tokens, start)) is not None:
            self.stats.finish_reason = "stop"
            # A round can write past the token that completed the stop string: end there, so the counts
            # (new tokens, tau, tokens/s, a server's usage) and a trainer's capture cover what a plain decode
            # writes.
            del self.tokens[end:], added[end - start:]
        if origins is not None:  # in place: a round's work must not grow with the answer
            self.origins += origins
            del self.origins[len(self.tokens):]
        self.stats.new_tokens = len(self.tokens)
        self.stats.count_deciders(len(added), kept, drafted)
        if self.finished:
            self.stats.wall_time = time.perf_counter() - self.started
        if self.on_tokens is not None:
            self.on_tokens(self, added)
        return self.finished


@renamed_keywords(draft_length="drafting")
class Batch:
    """The running batch: the target's rows, the drafter's, one Job per row, and the scheduler that sizes each
    round's drafts (diversed.decoding.scheduler).

    capacity: the most jobs at once. add() a job between rounds (admitted already: diversed.admission); step()
    runs one round (a step of the target alone, or a speculative round in which each row is verified by its own
    policy) and drops the jobs that finished or were cancelled; close() hands the measured costs to `costs`.
    Not thread-safe: one thread adds and steps (a server's engine thread); `Job.cancelled` is the one field
    other threads may set."""

    def __init__(self, target: Model, drafter: Drafter | None = None, *, drafting: Drafting = Drafting(),
                 eos_token_ids: Sequence[int] = (), capacity: int = 1, profile: bool = False,
                 costs: CostMemory | None = None) -> None:
        self.target, self.drafter = target, drafter
        self.scheduler = Scheduler(drafting, costs)
        self.eos = set(eos_token_ids)
        self.jobs: list[Job] = []
        self.capacity = capacity
        self.target_rows = target.rows(0, capacity)
        self.pending: list[list[int]] = []  # per row, what the target has not seen: the prompt, the last token
        self.clock = PhaseClock(target.device, synchronize=profile)
        self.start = time.perf_counter()
        self._joined = False  # jobs joined since the last round: the next round's forwards include prompts

    def add(self, job: Job) -> None:
        """Join a job: its rows are added now, its prompt is fed in the next round."""
        if len(self.jobs) >= self.capacity:
            raise RuntimeError(f"the batch is full ({self.capacity} jobs)")
        job.started = time.perf_counter()
        self.jobs.append(job)
        self.target_rows.extend(1)
        cached = self.target_rows.reuse(len(self.jobs) - 1, job.prompt) if job.cache_prompt else 0
        job.stats.cached_tokens = cached
        if self.drafter is not None:
            self.drafter.add(job.prompt, job.prediction, job.cache_prompt)
        self.pending.append(list(job.prompt[cached:]))
        self._joined = True

    @torch.inference_mode()
    def step(self) -> list[Job]:
        """One round for every job; returns the jobs that left the batch (finished or cancelled). A speculative
        round: the drafts, the target's pass over each row's pending tokens and drafts, each policy's rule on
        its rows, the target rolled back to the kept tokens, and what each row wrote."""
        for job in self.jobs:
            if job.cancelled and not job.finished:
                job.end("cancelled")
        left = self._drop([job.finished for job in self.jobs])
        if not self.jobs:
            return left
        self.clock.rounds += 1
        groups = Groups([job.policy for job in self.jobs])
        prefill, self._joined = self._joined, False
        proposal = self._propose(groups, prefill)
        lap = stopwatch(self.target.device, synchronize=self.scheduler.measured)
        if proposal is None:
            self._target_step(groups)
            self.scheduler.observe_step(lap(), prefill)
            return left + self._drop([job.finished for job in self.jobs])
        before, drafts = self.target_rows.lengths, proposal.tokens.tolist()
        with self.clock.phase("target forward"):
            h_target, logits = self.target_rows.feed([t + d for t, d in zip(self.pending, drafts, strict=True)],
                                                     len(drafts[0]) + 1, hidden=groups.hidden)
        with self.clock.phase("sampling"):
            p = groups.probs(logits)
        verdict = groups.verify(proposal, p, h_target, self.clock)
        kept, drafted = verdict.num_accepted.tolist(), proposal.lengths.tolist()
        with self.clock.phase("cache"):
            self.target_rows.truncate([b + len(t) + k for b, t, k in zip(before, self.pending, kept, strict=True)])
        seconds = lap()  # the pass, its sampling and verification: what a round of this width costs
        result = Round(proposal.tokens.to(p.device), verdict, proposal.lengths, proposal.q, p, proposal.hidden,
                       h_target)
        emitted = [d[:k] + [t] for d, k, t in zip(drafts, kept, verdict.next_token.tolist(), strict=True)]
        self.pending = [[e[-1]] for e in emitted]
        self.drafter.advance(emitted)
        for row, (job, new, source) in enumerate(zip(self.jobs, emitted, proposal.sources, strict=True)):
            job.stats.add_round(drafted[row], kept[row], proposal.forwards, source)
            if not _failed(job, groups, row):
                written = len(job.tokens)
                job.emit(new, self.eos, kept=kept[row], drafted=drafted[row],
                         origins=_origins(result, row, kept[row], new[-1], job, source) if job.provenance else None)
                if job.on_round is not None:
                    job.on_round(job, result, row, len(job.tokens) - written)
        self.scheduler.observe_round(proposal, kept, drafted, seconds, prefill)
        return left + self._drop([job.finished for job in self.jobs])

    def close(self) -> None:
        """Hand the measured costs (the speed schedule's) to the scheduler's CostMemory, for later batches of
        the same models."""
        self.scheduler.close()

    def generation(self, jobs: Sequence[Job]) -> Generation:
        """What these jobs of the batch wrote, with the batch's wall time and profile so far."""
        return Generation([j.tokens for j in jobs], [j.stats for j in jobs], time.perf_counter() - self.start,
                          self.clock.report(), [j.origins for j in jobs])

    def _propose(self, groups: Groups, prefill: bool) -> Proposal | None:
        """The round's drafts, None for a step of the target alone."""
        if self.drafter is None or not any(job.policy.drafts for job in self.jobs):
            return None
        draft = self.drafter.draft_model
        key = (_cost_identity(self.target), "" if draft is None else _cost_identity(draft), len(self.jobs))
        self.scheduler.begin(key, self.target.pass_tile, prefill)
        if not self.scheduler.longest:
            return None
        # A round writes up to (drafts + 1) tokens: drafting past what a sequence may still write is waste.
        room = [job.max_new_tokens - len(job.tokens) - 1 for job in self.jobs]
        ask = DraftRound(groups.draft_caps(self.scheduler.longest, room), [job.policy.drafter for job in self.jobs],
                         groups.draft_sample, groups.draft_hidden, self.scheduler.measured)
        with self.clock.phase("draft"):
            return self.scheduler.propose(self.drafter, ask)

    def _target_step(self, groups: Groups) -> None:
        """One step of the target alone: feed each row's pending tokens, sample the next token of each."""
        with self.clock.phase("target forward"):
            _, logits = self.target_rows.feed(self.pending, 1)
        with self.clock.phase("sampling"):
            probs = groups.probs(logits[:, -1])
            token = groups.sample(probs).tolist()
        self.pending = [[t] for t in token]
        if self.drafter is not None:
            self.drafter.advance([[t] for t in token])
        for row, (job, t) in enumerate(zip(self.jobs, token, strict=True)):
            job.stats.target_forwards += 1
            if not _failed(job, groups, row):
                written = len(job.tokens)
                job.emit([t], self.eos, origins=[target_origin(float(probs[row, t]), job.stats.target_forwards)]
                         if job.provenance else None)
                if job.on_round is not None:
                    job.on_round(job, None, row, len(job.tokens) - written)

    def _drop(self, finished: list[bool]) -> list[Job]:
        """Remove finished rows from the batch; returns their jobs."""
        if not any(finished):
            return []
        alive = [row for row, done in enumerate(finished) if not done]
        left = [job for job, done in zip(self.jobs, finished, strict=True) if done]
        with self.clock.phase("cache"):
            self.jobs = [self.jobs[row] for row in alive]
            self.target_rows.select(alive)
            if self.drafter is not None:
                self.drafter.select(alive)
            self.pending = [self.pending[row] for row in alive]
        return left


def _cost_identity(model: Model) -> str | int:
    """What the measured costs of a model belong to: its `cost_identity` where the backend has one (llama.cpp:
    the file and the threads, so that costs outlive the process), else the object itself."""
    return getattr(model, "cost_identity", None) or id(model)


def _failed(job: Job, groups: Groups, row: int) -> bool:
    """End the job of a row whose policy raised this round (Groups.failed); whether it did."""
    if row in groups.failed:
        error = groups.failed[row]
        job.end("error", f"{type(error).__name__}: {error}")
    return row in groups.failed


def _origins(result: Round, row: int, kept: int, next_token: int, job: Job, drafter: str | None
             ) -> list[TokenOrigin]:
    """How a row's new tokens of a speculative round were made (Job.provenance)."""
    length, verdict = int(result.lengths[row]), result.verdict
    q = None if result.q is None else result.q[row, :length]
    return round_origins(result.drafts[row, :length], q, result.p[row, :length + 1],
                         verdict.accept_prob[row, :length], verdict.uniform[row, :length], next_token, kept,
                         job.policy.sampling.greedy, drafter, job.stats.target_forwards)


@dataclass
class Round:
    """One speculative round of a batch: the drafts [B, n'] (row r drafted lengths[r] of them: below n' where
    its policy capped it or the confidence cut-off stopped it), the verdict, and what the verifier saw: q
    [B, n', V], p [B, n' + 1, V] and, where a policy needed them, the hidden states that produced them."""

    drafts: Tensor
    verdict: Verdict
    lengths: Tensor
    q: Tensor | None  # None: drafts copied from text (point masses)
    p: Tensor
    h_draft: Tensor | None  # [B, n', d_draft]
    h_target: Tensor | None  # [B, n' + 1, d_target]

"""The decoding loop: plain target decoding, and speculative decoding with any verification rule.

Both work on a batch of token-id prompts of different lengths, on any backend (diversed.backends: the loop
only feeds tokens, reads logits, truncates and selects rows). One round of speculative decoding
(`speculative_round`):
  1. the draft proposes up to N tokens, one forward each;
  2. the target scores the N+1 positions in one forward;
  3. the verifier (diversed.verify) keeps a prefix and picks the next token;
  4. both models roll back to the kept tokens.
Invariant between rounds: the target has seen every token but the last emitted one; the draft has seen
every token but the last emitted one and, after a fully kept round, the last draft. Before the first
round, the whole prompt is unseen: prefill is the first round's forward.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from diversed.backends import Model, Rows, as_model
from diversed.decoding.method import Method
from diversed.decoding.metrics import SequenceStats, summarize
from diversed.decoding.profile import PhaseClock
from diversed.decoding.sampling import Sampling
from diversed.decoding.schedule import DraftLength, SpeedModel
from diversed.verify import Verification, verify

# (draft hidden [B, N, d_draft], target hidden [B, N, d_target]) -> target weight w [B, N] in [0, 1].
WeightFn = Callable[[Tensor, Tensor], Tensor]
# The new tokens of a sequence so far -> whether a stop string has appeared.
StopFn = Callable[[list[int]], bool]


@dataclass
class Generation:
    """The new tokens of each prompt, per-sequence statistics, and the totals of the run.

    bonus[i][j] is True where token j of sequence i was drawn from the target's p after a fully kept round,
    not from the rule's verification target (training needs to tell them apart). profile: seconds per
    phase of the rounds (diversed.decoding.profile)."""

    tokens: list[list[int]]
    bonus: list[list[bool]]
    stats: list[SequenceStats]
    wall_time: float
    profile: dict[str, float]

    def summary(self) -> dict:
        return summarize(self.stats, self.wall_time)


@torch.inference_mode()
def decode(
    target,
    prompts: Sequence[Sequence[int]],
    *,
    draft=None,
    method: Method = Method("exact"),
    sampling: Sampling = Sampling(),
    draft_length: int | DraftLength = DraftLength(),
    max_new_tokens: int = 128,
    eos_token_ids: Sequence[int] = (),
    stop: StopFn | None = None,
    weight_fn: WeightFn | None = None,
    seed: int = 0,
    profile: bool = False,
) -> Generation:
    """Generate up to max_new_tokens after each prompt (token ids) with `method`.

    target, draft: backend models (diversed.backends) or transformers models. "auto" decodes with the
    target alone; every other method needs `draft`, and "diversed" a weight_fn (the trained head) that turns
    both models' last hidden states into a weight per drafted position. A sequence stops at any of
    eos_token_ids (kept in its tokens), when stop(tokens) is true, or at max_new_tokens. Seeded: the same
    inputs give the same tokens. profile=True makes the per-phase times of Generation.profile exact on a
    GPU (by waiting for the device around each phase).
    draft_length: a DraftLength, or an int N for N drafts every round.
    """
    target = as_model(target)
    draft = None if draft is None else as_model(draft)
    draft_length = DraftLength(draft_length) if isinstance(draft_length, int) else draft_length
    _check_request(target, draft, prompts, method, draft_length, max_new_tokens, weight_fn)
    generator = torch.Generator(device=target.device).manual_seed(seed)
    clock = PhaseClock(target.device, synchronize=profile or draft_length.schedule == "auto")
    run = _Run(prompts, max_new_tokens, set(eos_token_ids), stop)
    # The prompts are the first round's pending tokens: prefill happens inside the first forward.
    pending = [list(p) for p in prompts]
    if method.name == "auto":
        _plain_loop(run, target.rows(len(prompts)), pending, sampling, generator, clock)
    else:
        costs_key = (id(target), id(draft), len(prompts))  # the models and batch size the costs belong to
        speed = SpeedModel.for_models(costs_key, draft_length.maximum) if draft_length.schedule == "auto" else None
        _speculative_loop(run, target.rows(len(prompts)), draft.rows(len(prompts)), pending, method, sampling,
                          draft_length, speed, weight_fn, generator, clock)
        if speed is not None:
            speed.remember(costs_key)
    return Generation(run.tokens, run.bonus, run.stats, time.perf_counter() - run.start, clock.report())


class _Run:
    """Bookkeeping of one call: emitted tokens, statistics, and which sequences are still going."""

    def __init__(self, prompts, max_new_tokens: int, eos: set[int], stop: StopFn | None) -> None:
        self.tokens: list[list[int]] = [[] for _ in prompts]
        self.bonus: list[list[bool]] = [[] for _ in prompts]
        self.stats = [SequenceStats() for _ in prompts]
        self.rows = list(range(len(prompts)))  # original index of each active batch row
        self.max_new_tokens, self.eos, self.stop = max_new_tokens, eos, stop
        self.start = time.perf_counter()

    def emit(self, row: int, new: list[int], last_is_bonus: bool = False) -> bool:
        """Append a row's new tokens, cut at EOS or the length limit; True if the sequence is finished."""
        index = self.rows[row]
        tokens, stats = self.tokens[index], self.stats[index]
        for i, token in enumerate(new):
            tokens.append(token)
            self.bonus[index].append(last_is_bonus and i == len(new) - 1)
            if token in self.eos:
                stats.finish_reason = "eos"
                break
            if len(tokens) >= self.max_new_tokens:
                stats.finish_reason = "length"
                break
        if not stats.finish_reason and self.stop is not None and self.stop(tokens):
            stats.finish_reason = "stop"
        stats.new_tokens = len(tokens)
        if stats.finish_reason:
            stats.wall_time = time.perf_counter() - self.start
        return bool(stats.finish_reason)

    def emit_steps(self, tokens: list[int]) -> list[bool]:
        """Record one step of the target alone (one token per row); which rows it finished."""
        for row in self.rows:
            self.stats[row].target_forwards += 1
        return [self.emit(row, [t]) for row, t in enumerate(tokens)]

    def drop_finished(self, finished: list[bool], *states: Rows) -> list[int] | None:
        """Remove finished rows from the batch; returns the surviving row positions (None if all survive)."""
        if not any(finished):
            return None
        alive = [row for row, done in enumerate(finished) if not done]
        self.rows = [self.rows[row] for row in alive]
        for state in states:
            state.select(alive)
        return alive


def _plain_loop(run: _Run, target: Rows, pending: list[list[int]], sampling: Sampling,
                generator: torch.Generator, clock: PhaseClock) -> None:
    while run.rows:
        clock.rounds += 1
        token = target_step(target, pending, sampling, generator, clock)
        finished = run.emit_steps(token)
        with clock.phase("cache"):
            alive = run.drop_finished(finished, target)
        pending = [[t] for t in (token if alive is None else [token[row] for row in alive])]


def target_step(target: Rows, pending: list[list[int]], sampling: Sampling, generator: torch.Generator,
                clock: PhaseClock) -> list[int]:
    """One step of the target alone: feed each row's pending tokens, sample the next token of each."""
    with clock.phase("target forward"):
        _, logits = target.feed(pending, 1)
    with clock.phase("sampling"):
        return sampling.sample(sampling.probs(logits[:, -1]), generator).tolist()


@dataclass
class _Pending:
    """The tokens each model has not seen yet, per row. The target's: the prompt, then the last emitted
    token. The draft's: the prompt, then [last emitted] or, after a fully kept round, [last draft, it]."""

    target: list[list[int]]
    draft: list[list[int]]

    def select(self, alive: list[int]) -> None:
        self.target = [self.target[row] for row in alive]
        self.draft = [self.draft[row] for row in alive]


def speculative_round(target: Rows, draft: Rows, pending: _Pending, n: int, method: Method, sampling: Sampling,
                      confidence: float, weight_fn: WeightFn | None, generator: torch.Generator,
                      clock: PhaseClock) -> tuple[Tensor, Verification, Tensor]:
    """Draft up to n tokens per row, verify them in one target forward, roll both models back to the kept
    tokens and set `pending` for the next round. Returns the drafts [B, n'], the verdict and each row's own
    draft length [B] (below n' where the confidence cut-off stopped it)."""
    target_before, draft_before = target.lengths, draft.lengths
    needs_hidden = method.rule == "dynamic"
    drafts, q, h_draft, lengths = _draft(draft, pending.draft, n, sampling, confidence, needs_hidden, generator,
                                         clock)
    n_round = drafts.shape[1]
    with clock.phase("target forward"):
        h_target, logits = target.feed([t + d for t, d in zip(pending.target, drafts.tolist(), strict=True)],
                                       n_round + 1, hidden=needs_hidden)
    with clock.phase("sampling"):
        p = sampling.probs(logits)
    params = method.verify_params()
    if needs_hidden:
        with clock.phase("head"):
            params["weight"] = _checked_weights(weight_fn(h_draft, h_target[:, :n_round]), drafts.shape)
    with clock.phase("verify"):
        out = verify(method.rule, drafts, q, p, greedy=sampling.greedy, generator=generator, validate=False,
                     **params)
        out = _limit_to_drafted(out, lengths, p, sampling, generator)
    kept = out.num_accepted.tolist()
    with clock.phase("cache"):
        # The target keeps its pending tokens and the kept drafts; the draft, which never saw its own last
        # draft, keeps what it saw of them.
        target.truncate([b + len(t) + k for b, t, k in zip(target_before, pending.target, kept, strict=True)])
        draft.truncate([b + len(d) + min(k, n_round - 1)
                        for b, d, k in zip(draft_before, pending.draft, kept, strict=True)])
    last_draft, next_token = drafts[:, -1].tolist(), out.next_token.tolist()
    pending.target = [[t] for t in next_token]
    pending.draft = [[d, t] if k == n_round else [t] for d, t, k in zip(last_draft, next_token, kept, strict=True)]
    return drafts, out, lengths


def _speculative_loop(run: _Run, target: Rows, draft: Rows, prompts: list[list[int]], method: Method,
                      sampling: Sampling, draft_length: DraftLength, speed: SpeedModel | None,
                      weight_fn: WeightFn | None, generator: torch.Generator, clock: PhaseClock) -> None:
    # With costs known from an earlier call, the auto schedule chooses even the first round (the target
    # alone included: the draft then never reads the prompt unless drafting pays).
    n = speed.best_length() if speed is not None and speed.timed else draft_length.initial
    pending = _Pending(prompts, prompts)
    while run.rows:
        clock.rounds += 1
        before = dict(clock.seconds)
        finished = []
        if n == 0:  # the auto schedule predicts the target alone faster: a plain step, the draft catches up later
            token = target_step(target, pending.target, sampling, generator, clock)
            pending.target = [[t] for t in token]
            pending.draft = [d + [t] for d, t in zip(pending.draft, token, strict=True)]
            finished = run.emit_steps(token)
            if clock.rounds > 1:  # the first round's forward is the prompt's: not a step's cost
                speed.observe_plain(clock.seconds["target forward"] - before["target forward"])
            n = speed.best_length()
        else:
            catching_up = max(map(len, pending.draft)) > 2  # the draft missed target-alone steps' tokens
            # A round writes up to (drafts + 1) tokens: drafting past the most any sequence still needs is waste.
            needed = run.max_new_tokens - min(len(run.tokens[i]) for i in run.rows)
            drafts, out, lengths = speculative_round(target, draft, pending, min(n, max(needed - 1, 1)), method,
                                                     sampling, draft_length.confidence, weight_fn, generator, clock)
            n_round = drafts.shape[1]
            kept_counts, drafted_counts = out.num_accepted.tolist(), lengths.tolist()
            for row, (drafted_row, kept, drafted, nxt) in enumerate(
                    zip(drafts.tolist(), kept_counts, drafted_counts, out.next_token.tolist(), strict=True)):
                run.stats[run.rows[row]].add_round(drafted, kept, draft_forwards=n_round)
                finished.append(run.emit(row, drafted_row[:kept] + [nxt], last_is_bonus=kept == drafted))
            if speed is None:
                fully_kept = sum(k == d for k, d in zip(kept_counts, drafted_counts, strict=True)) / len(kept_counts)
                n = draft_length.next(n, fully_kept)  # from the length asked for: a confidence stop is no verdict
            elif clock.rounds > 1:  # the first round's forwards include the prompt: not a round's cost
                spent = {phase: clock.seconds[phase] - before[phase] for phase in ("draft forward", "target forward")}
                speed.observe(kept_counts, drafted_counts, n_round, None if catching_up else spent["draft forward"],
                              n_round + 1, spent["target forward"])
                n = speed.best_length()
        with clock.phase("cache"):
            alive = run.drop_finished(finished, target, draft)
        if alive is not None:
            pending.select(alive)


def _draft(draft: Rows, tokens: list[list[int]], n: int, sampling: Sampling, confidence: float, hidden: bool,
           generator: torch.Generator, clock: PhaseClock) -> tuple[Tensor, Tensor, Tensor | None, Tensor]:
    """Propose up to n tokens per sequence. Returns drafts [B, n'], their distributions q [B, n', V], the
    draft's hidden states that produced q [B, n', d] (when `hidden`), and each sequence's draft length [B]
    (n' or less when the confidence cut-off stopped it; n' < n when it stopped every sequence)."""
    drafts, probs, states = [], [], []
    lengths = torch.full((len(tokens),), n)
    for i in range(n):
        with clock.phase("draft forward"):
            h, logits = draft.feed(tokens, 1, hidden=hidden)
        with clock.phase("sampling"):
            q = sampling.probs(logits[:, -1])
            x = sampling.sample(q, generator)
        drafts.append(x)
        probs.append(q)
        if hidden:
            states.append(h[:, -1])
        if confidence:
            unsure = (q.gather(-1, x.unsqueeze(-1)).squeeze(-1) < confidence).cpu()
            lengths = torch.where(unsure & (lengths > i + 1), i + 1, lengths)
            if (lengths <= i + 1).all():
                lengths = lengths.clamp(max=i + 1)
                break
        tokens = [[t] for t in x.tolist()]
    return torch.stack(drafts, 1), torch.stack(probs, 1), torch.stack(states, 1) if hidden else None, lengths


def _limit_to_drafted(out: Verification, lengths: Tensor, p: Tensor, sampling: Sampling,
                      generator: torch.Generator) -> Verification:
    """Sequences that drafted fewer tokens than the round keep at most their own drafts; one that kept all
    of them gets its bonus token from p at the position after its last draft."""
    if bool((lengths == out.accepted.shape[1]).all()):
        return out
    lengths = lengths.to(p.device)
    short = out.num_accepted >= lengths
    num_accepted = torch.minimum(out.num_accepted, lengths)
    bonus = sampling.sample(p[torch.arange(len(lengths), device=p.device), lengths], generator)
    accepted = out.accepted & (torch.arange(out.accepted.shape[1], device=p.device) < lengths.unsqueeze(-1))
    return Verification(num_accepted, torch.where(short, bonus, out.next_token), accepted, out.accept_prob)


def _checked_weights(weight: Tensor, shape: torch.Size) -> Tensor:
    """A weight function's output must be one w in [0, 1] per drafted token (cheap to check: [B, N])."""
    if tuple(weight.shape) != tuple(shape):
        raise ValueError(f"weight_fn returned weights of shape {tuple(weight.shape)}, expected {tuple(shape)}")
    if not bool(((weight >= 0) & (weight <= 1)).all()):
        raise ValueError("weight_fn returned weights outside [0, 1] (or NaN)")
    return weight


def _check_request(target: Model, draft: Model | None, prompts, method, draft_length, max_new_tokens, weight_fn
                   ) -> None:
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("prompts must be a non-empty list of non-empty token-id sequences")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    models = [("target", target)]
    if method.name != "auto":
        if draft is None:
            raise ValueError(f"method {method.label!r} needs a draft model")
        models.append(("draft", draft))
    if method.rule == "dynamic" and weight_fn is None:
        raise ValueError(f"method {method.label!r} needs a weight_fn (a trained head) for its weights")
    longest = max(len(p) for p in prompts)
    lowest, highest = min(min(p) for p in prompts), max(max(p) for p in prompts)
    for role, model in models:
        needed = longest + max_new_tokens + draft_length.longest + 1
        if model.context_length is not None and needed > model.context_length:
            raise ValueError(f"the longest prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) + a round "
                             f"of drafts exceeds the {role}'s context of {model.context_length} tokens")
        if lowest < 0 or highest >= model.vocab_size:
            raise ValueError(f"a prompt token id is outside the {role}'s vocabulary")
    if draft is not None and method.name != "auto" and draft.vocab_size != target.vocab_size:
        raise ValueError(f"draft and target have different vocabularies ({draft.vocab_size} vs {target.vocab_size} "
                         "logits)")

"""How each row of a batch is decoded: its verification, sampling, random stream and head (a Policy), and the
per-round sampling and verification of a batch whose rows may follow different policies.

Rows that share one Policy object are sampled and verified together, one call of diversed.verify per
draft length among them; a server's rows, one policy per request, are verified request by request, each with
its own rule, weight and seed. Where the rows follow several policies, one whose sampling, head or rule
raises fails its own rows only (`failed`): the others' round goes on.

A request's draws do not depend on its company. Each round, a policy's random stream gives two fresh
streams of the round, one for drafting and one for the target's tokens (verification, a step of the target
alone), and each row is verified over its own drafts only: what other rows draft (longer rounds, draws past
this row's last draft) consumes nothing this row reads later.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Protocol, TypeVar, runtime_checkable

import torch
from torch import Tensor

from diversed.decoding.drafters.base import Proposal
from diversed.decoding.profile import PhaseClock
from diversed.decoding.sampling import probabilities, sample_tokens
from diversed.request import Sampling, Verification
from diversed.verify import Verdict, verify

# (draft hidden [B, N, d_draft], target hidden [B, N, d_target]) -> target weight w [B, N] in [0, 1].
WeightFn = Callable[[Tensor, Tensor], Tensor]
Output = TypeVar("Output", Tensor, Verdict)


@runtime_checkable
class LenienceHead(Protocol):
    """A head that sets rule "lossy"'s lenience per drafted token instead of a mixture weight
    (diversed.head.model.LenienceHead): lenience(drafts [B, N], q [B, N, V], p [B, N, V], target hidden
    [B, N, d_target], shift) -> L [B, N] in [0, 1), the verification's dial already applied. It reads no draft
    hidden state: q is None where the drafts were copied (point masses)."""

    rule: str  # "lossy"

    def lenience(self, drafts: Tensor, q: Tensor | None, p: Tensor, h_target: Tensor, shift: float | None
                 ) -> Tensor: ...


# What sets a "diversed" or "dynamic" verification's parameter per drafted token: a weight function (a mixture
# head, or any function of the hidden states) or a lenience head. A head declares the rule it sets (`rule`);
# a bare weight function sets "dynamic"'s weights.
Head = WeightFn | LenienceHead


def head_rule(head: Head) -> str:
    """The rule a head's values are for: its declared `rule`, "dynamic" for a bare weight function."""
    return getattr(head, "rule", "dynamic")


@dataclass(eq=False)
class Policy:
    """How a row is decoded. verification: "plain" (the target alone) or a rule; head: what sets a
    "diversed"/"dynamic" verification's per-token parameter, whose declared rule (head_rule) is the one this
    policy verifies with (`rule`, settled here); generator: the row's random stream; max_drafts: at most this
    many drafts a round for this row (None: the batch's draft length); drafter: which of an "auto" drafter's
    members may draft for this row ("auto": any)."""

    verification: Verification = Verification("exact")
    sampling: Sampling = Sampling()
    generator: torch.Generator | None = None
    head: Head | None = None
    max_drafts: int | None = None
    drafter: str = "auto"

    def __post_init__(self) -> None:
        self.uses_head = self.verification.rule == "dynamic" and self.head is not None
        self.rule = head_rule(self.head) if self.uses_head else self.verification.rule

    @property
    def drafts(self) -> bool:
        return self.verification.name != "plain"

    @property
    def reads_draft_hidden(self) -> bool:
        """Whether its head reads the draft model's hidden states (a mixture head: then only the draft model's
        drafts can be verified); a lenience head reads the target's alone."""
        return self.uses_head and self.rule == "dynamic"


class Groups:
    """The rows of one round grouped by policy (in order of first appearance)."""

    def __init__(self, policies: Sequence[Policy]) -> None:
        rows: dict[int, tuple[Policy, list[int]]] = {}
        for row, policy in enumerate(policies):
            rows.setdefault(id(policy), (policy, []))[1].append(row)
        self.size = len(policies)
        self.groups = list(rows.values())
        self.failed: dict[int, Exception] = {}  # row -> what its policy raised this round
        self.streams = {id(policy): _round_streams(policy) for policy, _ in self.groups}

    @property
    def hidden(self) -> bool:
        """Whether any row needs the target's hidden states (a head)."""
        return any(policy.verification.rule == "dynamic" for policy, _ in self.groups)

    @property
    def draft_hidden(self) -> bool:
        """Whether any row needs the draft model's hidden states (a mixture head)."""
        return any(policy.reads_draft_hidden for policy, _ in self.groups)

    def draft_caps(self, n: int, room: Sequence[int]) -> list[int]:
        """Each row's drafts this round: n, but at most room[r] (what row r may still write, less the round's
        own last token) and its policy's cap (0 for the target alone). A row's rounds then break where they
        would if it ran alone, whatever else is in the batch."""
        caps = [min(n, max(r, 1)) for r in room]
        for policy, rows in self.groups:
            for row in rows:
                caps[row] = 0 if not policy.drafts else min(caps[row], policy.max_drafts or n)
        return caps


    def probs(self, logits: Tensor) -> Tensor:
        """Each row's logits [B, ..., V] to its policy's sampling distributions."""
        return self._per_group(lambda policy, rows: probabilities(policy.sampling, logits[rows]),
                               lambda: torch.zeros(logits.shape, device=logits.device))

    def draft_sample(self, logits: Tensor) -> tuple[Tensor, Tensor]:
        """A draft model's logits [B, V] to each row's drafted token [B] and its distribution q [B, V]."""
        q = self.probs(logits)
        return self.sample(q, drafting=True), q

    def sample(self, probs: Tensor, drafting: bool = False) -> Tensor:
        """One token per row of probs [B, V] -> [B], each from its own policy's stream of the round: the
        drafting one for drafts, else the target's."""
        stream = 0 if drafting else 1
        return self._per_group(
            lambda policy, rows: sample_tokens(policy.sampling, probs[rows], self.streams[id(policy)][stream]),
            lambda: probs.new_zeros(self.size, dtype=torch.long))

    def verify(self, proposal: Proposal, p: Tensor, h_target: Tensor | None, clock: PhaseClock) -> Verdict:
        """Each group's rule on its rows' drafts (proposal.tokens [B, N], row r drafted proposal.lengths[r] of
        them; proposal.q [B, N, V], None for copied drafts, point masses) against p [B, N + 1, V]; each row is
        verified over its own drafts alone (a row that kept them all gets its bonus token from p after them),
        in one call of the rule per draft length among a group's rows. A group whose head or rule raises fails
        its own rows (`failed`) where others share the round; alone, it raises."""
        drafts, q, h_draft = proposal.tokens.to(p.device), proposal.q, proposal.hidden
        lengths, n = proposal.lengths.to(p.device), drafts.shape[1]
        out = Verdict(lengths.new_zeros(self.size), lengths.new_zeros(self.size),
                      torch.zeros(drafts.shape, dtype=torch.bool, device=p.device),
                      torch.zeros(drafts.shape, device=p.device), torch.zeros(drafts.shape, device=p.device))
        for policy, rows in self.groups:
            mine = slice(None) if len(self.groups) == 1 else torch.tensor(rows, device=p.device)
            try:
                params = policy.verification.verify_params()
                if policy.uses_head:
                    with clock.phase("head"):
                        params = _head_parameters(policy, drafts[mine], None if q is None else q[mine], p[mine, :n],
                                                  None if h_draft is None else h_draft[mine], h_target[mine, :n])
                generator = self.streams[id(policy)][1]
                with clock.phase("verify"):
                    own = lengths[mine]
                    for length in own.unique().tolist():
                        # Every row alike (one policy's batch, mostly): slices, not copies of p.
                        same = bool((own == length).all())
                        local = slice(None) if same else (own == length).nonzero().squeeze(-1)
                        at = local if isinstance(mine, slice) else mine if same else mine[local]
                        if length == 0:  # the target alone: p's token after no drafts, whatever the rule
                            out.next_token[at] = sample_tokens(policy.sampling, p[at, 0], generator)
                            continue
                        part = verify(policy.rule or "exact", drafts[at, :length],
                                      None if q is None else q[at, :length], p[at, :length + 1],
                                      greedy=policy.sampling.greedy, generator=generator, validate=False,
                                      **{k: v[local, :length] if isinstance(v, Tensor) else v
                                         for k, v in params.items()})
                        out.num_accepted[at], out.next_token[at] = part.num_accepted, part.next_token
                        out.accepted[at, :length], out.accept_prob[at, :length] = part.accepted, part.accept_prob
                        out.uniform[at, :length] = part.uniform
            except Exception as error:  # noqa: BLE001 - one policy's failure is its rows' alone
                if len(self.groups) == 1:
                    raise
                self.failed.update(dict.fromkeys(rows, error))
        return out

    def _per_group(self, compute: Callable[[Policy, slice | list[int]], Output],
                   zeros: Callable[[], Output]) -> Output:
        """compute(policy, rows) for each group, written into the rows of zeros() (a tensor, or a Verdict
        field by field); the rows of a group that raised (`failed`) stay zero. One group: compute's own result."""
        if len(self.groups) == 1:
            return compute(self.groups[0][0], slice(None))
        out = zeros()
        for policy, rows in self.groups:
            part = self._guarded(rows, compute, policy, rows)
            if part is None:
                continue
            if isinstance(out, Verdict):
                for field in fields(Verdict):
                    getattr(out, field.name)[rows] = getattr(part, field.name)
            else:
                out[rows] = part
        return out

    def _guarded(self, rows: list[int], compute: Callable, *args):
        """compute(*args) for a group of a mixed batch; None, and its rows failed, if it raises."""
        if any(row in self.failed for row in rows):
            return None
        try:
            return compute(*args)
        except Exception as error:  # noqa: BLE001 - one policy's failure is its rows' alone
            self.failed.update(dict.fromkeys(rows, error))
            return None


def _head_parameters(policy: Policy, drafts: Tensor, q: Tensor | None, p: Tensor, h_draft: Tensor | None,
                     h_target: Tensor) -> dict:
    """The per-token parameter a head sets for its rows' drafts [B, N] under its rule: a lenience head's L for
    "lossy", else the weight function's w for "dynamic", each with the verification's dial."""
    head, shift = policy.head, policy.verification.shift
    if policy.rule == "lossy":
        return {"lenience": _checked(head.lenience(drafts, q, p, h_target, shift), drafts.shape, "lenience", "[0, 1)")}
    return {"weight": shifted(_checked(head(h_draft, h_target), drafts.shape, "weight", "[0, 1]"), shift)}


def _checked(value: Tensor, shape: torch.Size, name: str, bounds: str) -> Tensor:
    """A head's output must be one value in `bounds` per drafted token (cheap to check: [B, N])."""
    if tuple(value.shape) != tuple(shape):
        raise ValueError(f"the head returned {name}s of shape {tuple(value.shape)}, expected {tuple(shape)}")
    inside = (value >= 0) & (value < 1 if bounds.endswith(")") else value <= 1)
    if not bool(inside.all()):
        raise ValueError(f"the head returned {name}s outside {bounds} (or NaN)")
    return value


def _round_streams(policy: Policy) -> tuple[torch.Generator | None, torch.Generator | None]:
    """This round's drafting and target streams of a policy, seeded by one draw from its own stream (None for
    a policy without one: torch's global stream, as before)."""
    if policy.generator is None or policy.sampling.greedy:
        return policy.generator, policy.generator
    seed = int(torch.randint(2**62, (1,), generator=policy.generator, device=policy.generator.device))
    return tuple(torch.Generator(policy.generator.device).manual_seed(seed + i) for i in (0, 1))


def shifted(weight: Tensor, shift: float | None) -> Tensor:
    """The head's strictness dial (Verification.shift): w -> sigmoid(logit(w) + shift); w = 0 and 1 stay put."""
    if not shift:
        return weight
    return torch.sigmoid(torch.logit(weight.float()) + shift).to(weight.dtype)

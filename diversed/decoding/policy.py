"""How each row of a batch is decoded: its method, sampling, random stream and head (a Policy), and the
per-round sampling and verification of a batch whose rows may follow different policies.

Rows that share one Policy object are sampled and verified together, in one call of diversed.verify, so a
batch of one policy (a `decode` call) runs exactly as if there were no grouping; a server's rows, one
policy per request, are verified request by request, each with its own rule, weight and seed. Where the
rows follow several policies, one whose sampling, head or rule raises fails its own rows only (`failed`):
the others' round goes on.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import TypeVar

import torch
from torch import Tensor

from diversed.decoding.method import Method
from diversed.decoding.profile import PhaseClock
from diversed.decoding.sampling import Sampling
from diversed.verify import Verification, verify

# (draft hidden [B, N, d_draft], target hidden [B, N, d_target]) -> target weight w [B, N] in [0, 1].
WeightFn = Callable[[Tensor, Tensor], Tensor]
Output = TypeVar("Output", Tensor, Verification)


@dataclass(eq=False)
class Policy:
    """How a row is decoded. method: "auto" (the target alone) or a rule; weight_fn: the head of a
    "diversed"/"dynamic" method; generator: the row's random stream; max_drafts: at most this many drafts
    a round for this row (None: the batch's draft length); drafter: which of an "auto" drafter's members may
    draft for this row ("auto": any)."""

    method: Method = Method("exact")
    sampling: Sampling = Sampling()
    generator: torch.Generator | None = None
    weight_fn: WeightFn | None = None
    max_drafts: int | None = None
    drafter: str = "auto"

    @property
    def drafts(self) -> bool:
        return self.method.name != "auto"


class Groups:
    """The rows of one round grouped by policy (in order of first appearance)."""

    def __init__(self, policies: Sequence[Policy]) -> None:
        rows: dict[int, tuple[Policy, list[int]]] = {}
        for row, policy in enumerate(policies):
            rows.setdefault(id(policy), (policy, []))[1].append(row)
        self.size = len(policies)
        self.groups = list(rows.values())
        self.failed: dict[int, Exception] = {}  # row -> what its policy raised this round

    @property
    def hidden(self) -> bool:
        """Whether any row needs the models' hidden states (a head)."""
        return any(policy.method.rule == "dynamic" for policy, _ in self.groups)

    def draft_caps(self, n: int, room: Sequence[int]) -> list[int]:
        """Each row's drafts this round: n, but at most room[r] (what row r may still write, less the round's
        own last token) and its policy's cap (0 for the target alone). A row's rounds then break where they
        would if it ran alone, whatever else is in the batch."""
        caps = [min(n, max(r, 1)) for r in room]
        for policy, rows in self.groups:
            for row in rows:
                caps[row] = 0 if not policy.drafts else min(caps[row], policy.max_drafts or n)
        return caps

    def only(self, drafter: str, caps: Sequence[int]) -> list[int]:
        """caps, with 0 for the rows whose policy does not let `drafter` draft for them."""
        caps = list(caps)
        for policy, rows in self.groups:
            if policy.drafter not in ("auto", drafter):
                for row in rows:
                    caps[row] = 0
        return caps

    def probs(self, logits: Tensor) -> Tensor:
        """Each row's logits [B, ..., V] to its policy's sampling distributions."""
        return self._per_group(lambda policy, rows: policy.sampling.probs(logits[rows]),
                               lambda: torch.zeros(logits.shape, device=logits.device))

    def sample(self, probs: Tensor) -> Tensor:
        """One token per row of probs [B, V] -> [B], each from its own policy's random stream."""
        return self._per_group(lambda policy, rows: policy.sampling.sample(probs[rows], policy.generator),
                               lambda: probs.new_zeros(self.size, dtype=torch.long))

    def verify(self, drafts: Tensor, q: Tensor, p: Tensor, lengths: Tensor, h_draft: Tensor | None,
               h_target: Tensor | None, clock: PhaseClock) -> Verification:
        """Each group's rule on its rows' drafts [B, N] (row r drafted lengths[r] of them), q [B, N, V] and
        p [B, N + 1, V]; a row that kept all of its own drafts gets its bonus token from p after them."""
        def one(policy: Policy, rows: slice | list[int]) -> Verification:
            params = policy.method.verify_params()
            if policy.method.rule == "dynamic":
                with clock.phase("head"):
                    params["weight"] = shifted(_checked_weights(policy.weight_fn(h_draft[rows], h_target[rows, :n]),
                                                                 drafts[rows].shape), policy.method.shift)
            with clock.phase("verify"):
                # The target-alone rows drafted nothing: any rule gives them p's token after their 0 drafts.
                out = verify(policy.method.rule or "exact", drafts[rows], q[rows], p[rows],
                             greedy=policy.sampling.greedy, generator=policy.generator, validate=False, **params)
                return _limit_to_drafted(out, lengths[rows], p[rows], policy)

        n = drafts.shape[1]
        lengths = lengths.to(p.device)
        return self._per_group(one, lambda: Verification(
            drafts.new_zeros(self.size), drafts.new_zeros(self.size),
            torch.zeros(drafts.shape, dtype=torch.bool, device=p.device), torch.zeros(drafts.shape, device=p.device)))

    def _per_group(self, compute: Callable[[Policy, slice | list[int]], Output],
                   zeros: Callable[[], Output]) -> Output:
        """compute(policy, rows) for each group, written into the rows of zeros() (a tensor, or a Verification
        field by field); the rows of a group that raised (`failed`) stay zero. One group: compute's own result."""
        if len(self.groups) == 1:
            return compute(self.groups[0][0], slice(None))
        out = zeros()
        for policy, rows in self.groups:
            part = self._guarded(rows, compute, policy, rows)
            if part is None:
                continue
            if isinstance(out, Verification):
                for field in fields(Verification):
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


def _limit_to_drafted(out: Verification, lengths: Tensor, p: Tensor, policy: Policy) -> Verification:
    """Sequences that drafted fewer tokens than the round keep at most their own drafts; one that kept all
    of them gets its bonus token from p at the position after its last draft."""
    if bool((lengths == out.accepted.shape[1]).all()):
        return out
    short = out.num_accepted >= lengths
    num_accepted = torch.minimum(out.num_accepted, lengths)
    bonus = policy.sampling.sample(p[torch.arange(len(lengths), device=p.device), lengths], policy.generator)
    accepted = out.accepted & (torch.arange(out.accepted.shape[1], device=p.device) < lengths.unsqueeze(-1))
    return Verification(num_accepted, torch.where(short, bonus, out.next_token), accepted, out.accept_prob)


def _checked_weights(weight: Tensor, shape: torch.Size) -> Tensor:
    """A weight function's output must be one w in [0, 1] per drafted token (cheap to check: [B, N])."""
    if tuple(weight.shape) != tuple(shape):
        raise ValueError(f"weight_fn returned weights of shape {tuple(weight.shape)}, expected {tuple(shape)}")
    if not bool(((weight >= 0) & (weight <= 1)).all()):
        raise ValueError("weight_fn returned weights outside [0, 1] (or NaN)")
    return weight


def shifted(weight: Tensor, shift: float | None) -> Tensor:
    """The head's strictness dial (Method.shift): w -> sigmoid(logit(w) + shift); w = 0 and 1 stay put."""
    if not shift:
        return weight
    return torch.sigmoid(torch.logit(weight.float()) + shift).to(weight.dtype)

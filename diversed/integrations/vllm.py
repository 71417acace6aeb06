"""Our verification rules inside vLLM (V1; written against vllm 0.32.0), chosen per request: a vLLM plugin.

`pip install diversed[vllm]` registers register() under vLLM's `vllm.general_plugins` entry point, which vLLM
runs in each of its processes before the engine starts. A request then picks a rule of diversed.request.RULE_SPECS:

    SamplingParams(temperature=0, extra_args={"verification": "static:0.7"})  # Python
    {"model": ..., "messages": ..., "verification": "static:0.7"}            # vllm serve's body

(vLLM's OpenAI server copies `vllm_xargs` into extra_args, and register() makes it copy a body's own
"verification" there too; `"vllm_xargs": {"verification": ...}` works as well.) The
environment variable DIVERSED_VERIFICATION sets a default for every request of a server; a request's
"verification": "vllm" keeps it on vLLM's own rejection sampler under that default. The spellings are
Verification.parse's: exact, lossy:L, static:W, cascade-chow:A, cascade-opt:A, cascade-token:A, typical[:EPS],
diversed[:[HEAD][@SHIFT]] (the learned head; it needs a draft model, whose hidden states it reads).

A request without a rule never reaches our code: vLLM computes its rows of the rejection sampler as always and
they are kept as they are, bit for bit. For a request with one, diversed.verify.verify decides with the
request's seeded generator if it has one, and ends a fully kept block with vLLM's bonus token. Its p is the
target's logits (after any structured-output mask) through diversed's Sampling with the request's
temperature, top_k and top_p, as in diversed's own engine; vLLM's penalties, bad words and logits processors
apply to vLLM's rows only. (Not vLLM's processed logits: on vLLM's CPU build 0.32.0, expand_batch_to_tokens
leaves the per-token temperature uninitialised, so they are garbage whenever T > 0.) Its q, the distribution
each draft was drawn from, is:
- at T = 0, the draft model's untempered softmax (vLLM drafts by argmax and keeps no distribution; kept here
  for the rules whose greedy decision reads q: the ensembles and the cascades);
- at T > 0, vLLM's draft probabilities when it passes them (speculative_config draft_sample_method
  "probabilistic": the draft then samples from its tempered softmax); otherwise the draft was deterministic
  and q is a point mass on each drafted token, as for the n-gram drafter at any temperature.

What register() patches (seven wrappers, each calling vLLM's original):
- ChatCompletionRequest and CompletionRequest.to_sampling_params: the body's "verification" into extra_args.
- SamplingParams.verify (run on each request before it reaches the engine): a bad verification string, a
  rule without speculative decoding, or the head without a draft model is refused there (HTTP 400).
- GPUModelRunner.sample_tokens (inherited by the CPU runner): each row's Verification and the target's last hidden
  states at the verified positions go into a step context, read by the next wrapper.
- vllm.v1.sample.rejection_sampler.rejection_sample: after vLLM's own result, the rows with a rule are redone.
- GPUModelRunner.propose_draft_token_ids with SpecDecodeBaseProposer._sample_draft_tokens: while the draft
  model drafts for a batch that needs them, the draft's distributions (T = 0) and last hidden states (the
  head) are kept per request for the next step's verification, as vLLM keeps its own draft probabilities.
vLLM's spec-decode counters and its per-request acceptance (per_request_spec_decode_metrics) count the tokens
the rows emit, so they report our rules' acceptance with no change.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from diversed.decoding.policy import shifted  # the head's strictness dial: the engine's own
from diversed.decoding.sampling import probabilities
from diversed.head.model import EnsembleHead
from diversed.head.names import head_folder
from diversed.request import RULE_SPECS, Sampling, Verification
from diversed.verify import verify

KEY = "verification"  # the extra_args field a request sets
DEFAULT_ENV = "DIVERSED_VERIFICATION"  # a server-wide default rule
VLLM_OWN = "vllm"  # the value that keeps a request on vLLM's rejection sampler
PLACEHOLDER = -1  # vLLM's PLACEHOLDER_TOKEN_ID: an unused slot in a row of output tokens
# At T = 0 these decide on argmax p alone, so the draft's distribution is not needed (lossy's lenience only
# relaxes the sampled test; typical never reads q).
_GREEDY_IGNORES_Q = ("exact", "lossy", "typical")
FORMS = ", ".join([*(f"{name}:{spec.parameters[0].upper()}" if spec.parameters and not spec.optional
                     else f"{name}[:{spec.parameters[0].upper()}]" if spec.parameters else name
                     for name, spec in RULE_SPECS.items() if name != "dynamic"),
                   "diversed[:[HEAD][@SHIFT]]", f"{VLLM_OWN} (vLLM's own)"])

logger = logging.getLogger(__name__)
_default: Verification | None = None  # DIVERSED_VERIFICATION, read once by register()
_step: _Step | None = None  # the rows of the sample_tokens call in progress (one engine thread per process)


@functools.lru_cache(maxsize=256)
def parse_verification(text: str) -> Verification | None:
    """A verification string -> its Verification; None for "vllm". ValueError, with the accepted forms, otherwise."""
    if text == VLLM_OWN:
        return None
    try:
        verification = Verification.parse(text)
        if verification.rule is None:
            raise ValueError("'plain' (the target alone) verifies nothing; run vLLM without speculative_config")
        if verification.name == "diversed":
            head_folder(verification.head)  # only looks at the files: cheap enough for every request
    except (ValueError, FileNotFoundError) as err:
        raise ValueError(f"bad {KEY} {text!r}: {err}; use one of {FORMS}") from None
    return verification


def request_verification(extra_args: Mapping | None, default: Verification | None = None) -> Verification | None:
    """The Verification a request asks for (extra_args["verification"], else the default); None: vLLM's own path."""
    if not extra_args or KEY not in extra_args:
        return default
    value = extra_args[KEY]
    if not isinstance(value, str):
        raise ValueError(f"{KEY} must be a string such as 'static:0.7', got {type(value).__name__} {value!r}")
    return parse_verification(value.strip())


@dataclass
class _Recorder:
    """What the draft model's proposal steps keep for one propose call: per step, q [rows, V] (T = 0 rows) and
    the last hidden states [rows, d] (the head), each only when some row of the batch needs it."""

    q: bool
    hidden: bool
    steps: list[tuple[Tensor | None, Tensor | None]] = field(default_factory=list)

    def by_request(self, req_ids: list[str]) -> dict[str, tuple[Tensor | None, Tensor | None]]:
        """Request id -> (q [k, V], hidden [k, d]). Rows are request-major: [B, steps] for sequential
        drafting, [B * k, 1] for a parallel drafter's single step, both reshaped to [B, k]."""
        def per_row(index: int) -> Tensor | None:
            parts = [step[index] for step in self.steps]
            if not parts or any(part is None for part in parts):
                return None
            stacked = torch.stack(parts, 1)
            return stacked.reshape(len(req_ids), -1, stacked.shape[-1])

        q, hidden = per_row(0), per_row(1)
        return {req_id: (None if q is None else q[i], None if hidden is None else hidden[i])
                for i, req_id in enumerate(req_ids)}


@dataclass
class _Step:
    """One sample_tokens call: per row of the batch its Verification (None: vLLM's) and Sampling; the target's logits
    (all rows of the step) and which of them each verified position is; the draft records of the proposals
    being verified; the target's hidden states at each verified position (for a head)."""

    rows: list[tuple[Verification | None, Sampling | None]]
    req_ids: list[str]
    logits: Tensor
    target_index: Tensor
    drafted: dict[str, tuple[Tensor | None, Tensor | None]]
    target_hidden: Tensor | None


def _batch_rows(runner) -> list[tuple[Verification | None, Sampling | None]]:
    """(Verification, Sampling) for each row of the runner's input batch, from each request's SamplingParams."""
    from vllm.sampling_params import SamplingType

    rows = []
    for req_id in runner.input_batch.req_ids:
        params = runner.requests[req_id].sampling_params
        verification = None if params is None else request_verification(params.extra_args, _default)  # None: pooling
        if verification is None:
            rows.append((None, None))
            continue
        greedy = params.sampling_type == SamplingType.GREEDY
        # vLLM's top_k -1 and 0 both mean off, diversed's 0.
        rows.append((verification, Sampling(0.0 if greedy else params.temperature, max(params.top_k, 0), params.top_p)))
    return rows


def _wrap_sample_tokens(original):
    @functools.wraps(original)
    def sample_tokens(self, grammar_output):
        global _step
        state = self.execute_model_state
        _step = None
        if state is not None and state.spec_decode_metadata is not None:
            rows = _batch_rows(self)
            if any(verification is not None for verification, _ in rows):
                index = state.spec_decode_metadata.target_logits_indices
                head = any(verification is not None and verification.rule == "dynamic" for verification, _ in rows)
                # The logits are held by reference: a structured-output mask, applied in place next, applies.
                _step = _Step(rows, list(self.input_batch.req_ids), state.logits, index,
                              getattr(self, "_diversed_drafted", {}),
                              state.sample_hidden_states[index] if head else None)
        try:
            return original(self, grammar_output)
        finally:
            _step = None

    return sample_tokens


def _wrap_propose(original):
    @functools.wraps(original)
    def propose_draft_token_ids(self, *args, **kwargs):
        rows = _batch_rows(self)
        want_q = any(verification is not None and sampling.greedy and verification.rule not in _GREEDY_IGNORES_Q
                     for verification, sampling in rows)
        want_hidden = any(verification is not None and verification.rule == "dynamic" for verification, _ in rows)
        recorder = _Recorder(want_q, want_hidden) if want_q or want_hidden else None
        self.drafter._diversed_recorder = recorder  # only a draft model reads it (n-gram drafters have no model)
        try:
            drafts = original(self, *args, **kwargs)
        finally:
            self.drafter._diversed_recorder = None
        self._diversed_drafted = recorder.by_request(list(self.input_batch.req_ids)) if recorder else {}
        return drafts

    return propose_draft_token_ids


def _wrap_sample_draft_tokens(original):
    @functools.wraps(original)
    def _sample_draft_tokens(self, hidden_states, sampling_metadata):
        drafts = original(self, hidden_states, sampling_metadata)
        recorder = getattr(self, "_diversed_recorder", None)
        if recorder is not None and not getattr(self, "use_heterogeneous_vocab", False):
            # The logits once more (vLLM's greedy path keeps none): one draft LM-head pass, only in batches
            # with a T = 0 rule that reads q. Hidden states are copied: later steps reuse vLLM's buffers.
            q = self.model.compute_logits(hidden_states).float().softmax(-1) if recorder.q else None
            hidden = hidden_states.to(torch.float32, copy=True) if recorder.hidden else None
            recorder.steps.append((q, hidden))
        return drafts

    return _sample_draft_tokens


def _wrap_rejection_sample(original):
    @functools.wraps(original)
    def rejection_sample(draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens, draft_probs,
                         target_logits, bonus_token_ids, sampling_metadata, *args, **kwargs):
        output = original(draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens, draft_probs,
                          target_logits, bonus_token_ids, sampling_metadata, *args, **kwargs)
        if _step is not None and len(_step.rows) == len(num_draft_tokens):  # warm-up runs carry no step
            _verify_rows(_step, output, draft_token_ids, num_draft_tokens, draft_probs, bonus_token_ids,
                         sampling_metadata.generators)
        return output

    return rejection_sample


def check_request(extra_args: Mapping | None, speculative_config, default: Verification | None = None) -> None:
    """ValueError unless the request's rule can run on this engine: a valid string, speculative decoding on,
    and a draft model for the head (the only drafter whose hidden states the head was trained on)."""
    verification = request_verification(extra_args, default)
    if verification is None:
        return
    if speculative_config is None:
        raise ValueError(f"{KEY} {verification.label!r} needs speculative decoding: start vLLM with a "
                         "speculative_config (a draft model or n-gram drafter)")
    if verification.name == "diversed" and speculative_config.method != "draft_model":
        raise ValueError(f"{KEY} {verification.label!r} reads the draft model's hidden states: it needs "
                         f"speculative_config method 'draft_model', not {speculative_config.method!r}")


def _wrap_to_sampling_params(original):
    """`vllm serve`: a request body's own "verification" field (vLLM's request models keep unknown fields in
    model_extra) goes into extra_args beside vllm_xargs, where a value there wins."""

    @functools.wraps(original)
    def to_sampling_params(self, *args, **kwargs):
        params = original(self, *args, **kwargs)
        value = (self.model_extra or {}).get(KEY)
        if value is not None and KEY not in (params.extra_args or {}):
            params.extra_args = {**(params.extra_args or {}), KEY: value}
        return params

    return to_sampling_params


def _wrap_verify(original):
    from vllm.exceptions import VLLMValidationError

    @functools.wraps(original)
    def verify(self, model_config, speculative_config, *args, **kwargs) -> None:
        original(self, model_config, speculative_config, *args, **kwargs)
        try:
            check_request(self.extra_args, speculative_config, _default)
        except ValueError as err:
            raise VLLMValidationError(str(err), parameter=f"extra_args.{KEY}") from None

    return verify


def _verify_rows(step: _Step, output: Tensor, draft_token_ids: Tensor, num_draft_tokens: list[int],
                 draft_probs: Tensor | None, bonus_token_ids: Tensor, generators: dict[int, torch.Generator]) -> None:
    """Overwrite output [B, max_spec_len + 1] in the rows with a rule by diversed.verify's decision. Rows are
    verified together when they share a rule, sampling, draft count and no generator of their own."""
    starts = [0, *itertools.accumulate(num_draft_tokens)]
    groups: dict[tuple, list[int]] = {}
    for row, (verification, sampling) in enumerate(step.rows):
        if verification is not None and num_draft_tokens[row] > 0:  # no drafts: vLLM's token is the target's
            seeded = row if row in generators else None
            groups.setdefault((verification, sampling, num_draft_tokens[row], seeded), []).append(row)
    vocab = step.logits.shape[-1]
    for (verification, sampling, n, seeded), rows in groups.items():
        greedy = sampling.greedy
        tokens = torch.tensor([list(range(starts[r], starts[r] + n)) for r in rows], device=step.logits.device)
        drafts = draft_token_ids[tokens].long()
        p = torch.cat([probabilities(sampling, step.logits[step.target_index[tokens]]),  # [G, n, V]
                       F.one_hot(bonus_token_ids[rows, 0].long(), vocab).float().unsqueeze(1)], 1)
        q = _draft_distributions(step, rows, tokens, drafts, greedy, draft_probs)
        params = verification.verify_params()
        if verification.rule == "dynamic":
            params["weight"] = _head_weights(verification, step, rows, tokens)
        # The bonus row is vLLM's sampled bonus token as a point mass, so a fully kept block ends with it.
        out = verify(verification.rule, drafts, q, p, greedy=greedy, generator=generators.get(seeded), validate=False,
                     **params)
        block = torch.where(out.accepted, drafts, PLACEHOLDER)
        block = torch.cat([block, block.new_full((len(rows), output.shape[1] - n), PLACEHOLDER)], 1)
        block.scatter_(1, out.num_accepted.unsqueeze(1), out.next_token.unsqueeze(1))
        output[rows] = block.to(output.dtype)


def _draft_distributions(step: _Step, rows: list[int], tokens: Tensor, drafts: Tensor, greedy: bool,
                         draft_probs: Tensor | None) -> Tensor | None:
    """q [G, n, V]: what each draft was drawn from (see the module's docstring); None for point masses (drafts
    that no distribution is known for, as n-gram drafts: verify() takes them as ids)."""
    n = drafts.shape[1]
    if greedy:
        recorded = [step.drafted.get(step.req_ids[r], (None, None))[0] for r in rows]
        if all(q is not None for q in recorded):
            return torch.stack([q[:n] for q in recorded])
    elif draft_probs is not None:
        return draft_probs[tokens].float()
    return None


def _head_weights(verification: Verification, step: _Step, rows: list[int], tokens: Tensor) -> Tensor:
    """w [G, n] from the head on both models' last hidden states at the drafted positions."""
    hidden = [step.drafted.get(step.req_ids[r], (None, None))[1] for r in rows]
    if step.target_hidden is None or any(h is None for h in hidden):  # check_request refuses such requests
        raise RuntimeError("verification 'diversed' found no draft hidden states (is the drafter a draft model?)")
    h_draft = torch.stack([h[: tokens.shape[1]] for h in hidden])
    h_target = step.target_hidden[tokens].float()
    head = _head(verification.head, h_draft.shape[-1], h_target.shape[-1], str(h_target.device))
    return shifted(head(h_draft, h_target), verification.shift)


@functools.lru_cache(maxsize=8)
def _head(name: str | None, draft_hidden: int, target_hidden: int, device: str) -> EnsembleHead:
    """A head loaded once per process; refused if trained for other hidden sizes. (Its model names are not
    compared: vLLM names models by path.)"""
    return EnsembleHead.load(name, draft_hidden=draft_hidden, target_hidden=target_hidden).to(device).eval()


def register() -> None:
    """The vllm.general_plugins entry point: patch vLLM (idempotent: vLLM may call it more than once)."""
    global _default
    from vllm import sampling_params
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.v1.sample import rejection_sampler
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    text = os.environ.get(DEFAULT_ENV, "").strip()
    _default = parse_verification(text) if text else None  # a bad default fails every process at start
    if getattr(rejection_sampler.rejection_sample, "_diversed", False):
        return
    for owner, name, wrap in ((sampling_params.SamplingParams, "verify", _wrap_verify),
                              (ChatCompletionRequest, "to_sampling_params", _wrap_to_sampling_params),
                              (CompletionRequest, "to_sampling_params", _wrap_to_sampling_params),
                              (GPUModelRunner, "sample_tokens", _wrap_sample_tokens),
                              (GPUModelRunner, "propose_draft_token_ids", _wrap_propose),
                              (SpecDecodeBaseProposer, "_sample_draft_tokens", _wrap_sample_draft_tokens),
                              (rejection_sampler, "rejection_sample", _wrap_rejection_sample)):
        patched = wrap(getattr(owner, name))
        patched._diversed = True
        setattr(owner, name, patched)
    logger.info("diversed: verification rules installed in vLLM (default: %s)", _default.label if _default else
                VLLM_OWN)

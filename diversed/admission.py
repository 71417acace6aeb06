"""A request meets the loaded pair: what only the models can tell is checked (the chat template, the context, a
head that fits, a draft model where one is needed), the prompts are tokenized and the jobs of the decoding loop
are built. generate() and the server both submit through admit(); nothing below it checks a request again."""

from __future__ import annotations

import secrets
from collections.abc import Mapping

import torch
from jinja2 import TemplateError  # what transformers' chat templates raise, raise_exception() included

from diversed.decoding.engine import Job
from diversed.decoding.policy import Head, Policy, head_rule
from diversed.head.model import EnsembleHead
from diversed.models.loading import Pair
from diversed.request import DEFAULT_DRAFTING, ContextTooLong, Drafting, HeadNotFound, Request, RequestError
from diversed.text import encode_prompt, stop_checker


def admit(request: Request, pair: Pair, heads: Mapping[str | None, Head] | None = None) -> list[Job]:
    """The request's jobs, one per prompt, in order; those of one batch (request.batch_size prompts) share one
    policy and random stream, seeded by request.seed plus the batch's first index (a random seed where it is
    None). heads: the heads by name that a "diversed" or "dynamic" verification may use (None under the name
    of the default one); None: load the one the verification names (a folder, or a shipped head's name).
    RequestError names the field a model refuses."""
    tokenizer, target, draft = pair.tokenizer, pair.target, pair.draft
    drafting = request.drafting or DEFAULT_DRAFTING[pair.backend]
    chat = request.chat
    if chat is None:  # a conversation needs the template; a text uses it where the tokenizer has one
        chat = any(isinstance(p, list) for p in request.prompts) or tokenizer.chat_template is not None
    if chat and tokenizer.chat_template is None:
        field = "chat" if request.chat else "prompt"
        raise RequestError(field, f"the tokenizer of {pair.target_name} has no chat template: the {{}} needs one "
                                  "(send text, not a conversation)")
    head = _head(request, pair, heads)
    reads_draft = head is not None and head_rule(head) == "dynamic"  # a mixture head reads the draft's hidden states
    if request.drafter == "model" and draft is None:
        raise RequestError("drafter", "{} 'model' needs a draft model, and this pair has none: use 'auto', "
                                      "'lookup' or 'suffix'")
    if reads_draft and (draft is None or request.drafter not in ("auto", "model")):
        raise RequestError("drafter", f"verification {request.verification.label!r} has a mixture head, which "
                                      f"reads the draft model's hidden states: {{}} {request.drafter!r} has none"
                                      + (" (and this pair has no draft model)" if draft is None else
                                         " (use 'model' or 'auto')"))
    if reads_draft and any(p is not None for p in request.predictions):
        raise RequestError("prediction", f"verification {request.verification.label!r} has a mixture head, which "
                                         "verifies the draft model's drafts only: a {} would go unused")
    jobs, policy = [], None
    for index, (prompt, prediction) in enumerate(zip(request.prompts, request.predictions, strict=True)):
        try:
            ids = encode_prompt(tokenizer, prompt, chat, request.system)
        except TemplateError as error:  # a template's own refusal, e.g. "roles must alternate"
            raise RequestError("prompt", f"the chat template refused the {{}}: {error}") from None
        _check_tokens(ids, pair)
        room = context_room(pair, len(ids), drafting)
        if room < 1:
            raise ContextTooLong("prompt", f"the {{}} ({len(ids)} tokens) leaves no room for new tokens in the "
                                           f"context of {_context(pair)} tokens")
        if request.max_new_tokens is not None and request.max_new_tokens > room:
            raise ContextTooLong("max_new_tokens", f"the prompt ({len(ids)} tokens) + {{}} "
                                                   f"({request.max_new_tokens}) + a round of drafts exceeds the "
                                                   f"context of {_context(pair)} tokens")
        predicted = None if prediction is None else tokenizer(prediction, add_special_tokens=False)["input_ids"]
        if predicted is not None and target.context_length is not None and \
                len(ids) + len(predicted) > target.context_length:
            raise ContextTooLong("prediction", f"the prompt ({len(ids)} tokens) + the {{}} ({len(predicted)}) "
                                               f"exceed the target's context of {target.context_length} tokens")
        if index % request.batch_size == 0:  # a batch's rows share one policy, as they are verified together
            seed = secrets.randbits(63) if request.seed is None else (request.seed + index) % 2**63
            policy = Policy(request.verification, request.sampling,
                            torch.Generator(device=target.device).manual_seed(seed), head, request.max_drafts,
                            request.drafter)
        jobs.append(Job(ids, policy, request.max_new_tokens or room, stop_checker(tokenizer, request.stop),
                        prediction=predicted, provenance=request.provenance, cache_prompt=request.cache_prompt))
    return jobs


def context_room(pair: Pair, prompt_length: int, drafting: Drafting) -> int:
    """The most new tokens a prompt may have: what the models' context leaves after it and a round of drafts."""
    contexts = [m.context_length for m in (pair.target, pair.draft) if m is not None and m.context_length]
    return (min(contexts) if contexts else 2**31) - prompt_length - drafting.longest - 1


def load_head(pair: Pair, head: str | None = None) -> EnsembleHead:
    """A trained head for this pair (a folder, or the name of a head shipped for the default pair; None: the
    default one), refused if it was trained for other models."""
    draft = pair.draft
    return EnsembleHead.load(head, draft_hidden=None if draft is None else draft.hidden_size,
                             target_hidden=pair.target.hidden_size, draft_model=None if draft is None else
                             pair.draft_name, target_model=pair.target_name).to(pair.target.device)


def _head(request: Request, pair: Pair, heads: Mapping[str | None, Head] | None) -> Head | None:
    """The head a verification needs ("diversed", "dynamic"), None for the others."""
    verification = request.verification
    if verification.rule != "dynamic":
        return None
    if heads is None:
        if verification.name == "dynamic":
            raise RequestError("verification", "{} 'dynamic' needs a weight function (a head) for its weights")
        return load_head(pair, verification.head)
    if verification.head not in heads:
        loaded = ", ".join(sorted(name for name in heads if name is not None)) or "none"
        raise HeadNotFound("head", f"no {{}} named {verification.head!r} is loaded (loaded: {loaded})"
                           if verification.head is not None else
                           f"verification {verification.label!r} needs a {{}}, and none is loaded")
    return heads[verification.head]


def _check_tokens(ids: list[int], pair: Pair) -> None:
    """A prompt's tokens: at least one, each in both models' vocabularies."""
    if not ids:
        raise RequestError("prompt", "the {} is empty once tokenized")
    for role, model in (("target", pair.target), ("draft", pair.draft)):
        if model is not None and (min(ids) < 0 or max(ids) >= model.vocab_size):
            raise RequestError("prompt", f"a {{}} token id is outside the {role}'s vocabulary")


def _context(pair: Pair) -> int:
    return min(m.context_length for m in (pair.target, pair.draft) if m is not None and m.context_length)

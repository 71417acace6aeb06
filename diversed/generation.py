"""Text in, text out: chat templates, tokenization, batching and stop strings around the decoding loop."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from diversed.decoding.drafters import SuffixCache, prediction_tokens
from diversed.decoding.engine import context_room, decode
from diversed.decoding.policy import WeightFn
from diversed.decoding.provenance import records
from diversed.head.model import EnsembleHead
from diversed.models.loading import Pair
from diversed.request import DEFAULT_DRAFTING, DraftLength, Verification, check_request, renamed_keywords
from diversed.text import StreamedText, TokenTexts, cut_at_stop, encode_prompt, stop_checker


@dataclass
class Completion:
    """One prompt's generated text, its new token ids, its metrics (diversed.decoding.metrics) and, if asked
    for, how each token was made (diversed.decoding.provenance.records)."""

    prompt: str | list[dict]
    text: str
    tokens: list[int]
    metrics: dict
    provenance: list[dict] | None = None

    def to_dict(self) -> dict:
        """The JSON form: text and the headline metrics at the top level, all metrics under "metrics"."""
        headline = {k: self.metrics[k] for k in ("new_tokens", "wall_time", "acceptance_rate", "tau",
                                                  "tokens_per_s")}
        return {"prompt": self.prompt, "text": self.text, **headline, "metrics": self.metrics} | \
            ({} if self.provenance is None else {"provenance": self.provenance})


@renamed_keywords(method="verification")
def generate(
    pair: Pair,
    prompts: str | Sequence[str | list[dict]],
    *,
    verification: str | Verification = "exact",
    drafter: str = "auto",
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    draft_length: int | DraftLength | None = None,
    max_new_tokens: int | None = None,
    stop: Sequence[str] = (),
    chat: bool | None = None,
    system: str | None = None,
    batch_size: int = 1,
    seed: int = 0,
    weight_fn: WeightFn | None = None,
    profile: bool = False,
    on_text: Callable[[int, str], None] | None = None,
    on_tokens: Callable[[int, list[int]], None] | None = None,
    cache: SuffixCache | None = None,
    prediction: str | Sequence[str | None] | None = None,
    provenance: bool = False,
) -> list[Completion]:
    """Generate a completion for each prompt (a string, or a conversation: chat messages with role and content)
    with the pair and a verification ("plain", "exact", "static:0.7",
    "diversed:HEAD" with a head's folder or a shipped head's name, ...). weight_fn overrides the head of a
    "diversed" verification (or drives "dynamic").

    drafter: what proposes the drafts (diversed.decoding.drafters): "auto" (each round the fastest of copying
    from the text so far and earlier outputs, the draft model, or none, under the auto schedule), "model",
    "lookup" (prompt lookup), "suffix" (a suffix cache shared by the batches of this call, or `cache`) or
    "prediction" (the request's prediction only).
    draft_length: N drafts a round, a DraftLength, or None for the backend's default (DEFAULT_DRAFTING).
    chat: wrap each prompt in the tokenizer's chat template (None: whenever the tokenizer has one).
    max_new_tokens: at most so many new tokens; None: until the end of the answer (EOS or a stop string), or
    as many as the models' context leaves after the longest prompt of a batch, as llama.cpp and OpenAI do.
    stop: strings that end a sequence; its text is cut before the first one.
    batch_size: prompts decoded together (each batch's metrics carry its own wall time).
    profile: add metrics["profile"], the seconds per phase of the prompt's batch (exact on a GPU too).
    on_text(i, piece): called with prompt i's new text as it is generated (streaming); the pieces of a prompt
    join into its Completion.text. on_tokens(i, new): the same with its new token ids (progress).
    prediction: what the answer is expected to repeat, most of it (OpenAI's Predicted Outputs: a file to be
    returned with one change): one string for every prompt, or a list of one per prompt (None: none). The
    "auto" drafter then drafts from it first ("prediction": from it only), and each Completion's metrics
    count its accepted and rejected tokens as OpenAI does.
    provenance: each Completion's `provenance` says how each new token was made: drafted and kept (by which
    drafter), kept by a relaxed rule where exact would have rejected it, a correction, a bonus, or the target
    alone, with the probabilities behind it (diversed.decoding.provenance).
    """
    request = check_request(prompts, verification=verification, drafter=drafter, temperature=temperature,
                            top_k=top_k, top_p=top_p, draft_length=draft_length, max_new_tokens=max_new_tokens,
                            stop=stop, batch_size=batch_size, seed=seed, prediction=prediction)
    prompts, verification, stop = request.prompts, request.verification, request.stop
    draft_length = DEFAULT_DRAFTING[pair.backend] if request.draft_length is None else request.draft_length
    if verification.name == "diversed" and weight_fn is None:
        weight_fn = load_head(pair, verification.head)
    tokenizer = pair.tokenizer
    if (chat or (chat is None and any(isinstance(p, list) for p in prompts))) and tokenizer.chat_template is None:
        raise ValueError(f"the tokenizer of {pair.target_name} has no chat template; pass chat=False and text "
                         "prompts")
    if chat is False and any(isinstance(p, list) for p in prompts):
        raise ValueError("a conversation (chat messages) needs the chat template: not with chat=False")
    ids = [encode_prompt(tokenizer, p, chat, system) for p in prompts]
    predicted = [None if text is None else tokenizer(text, add_special_tokens=False)["input_ids"]
                 for text in request.predictions]

    streams = [StreamedText(tokenizer, stop) for _ in prompts]

    def stream(i: int, new: list[int]) -> None:
        if on_tokens is not None:
            on_tokens(i, new)
        if on_text is not None and (piece := streams[i].add(new)):
            on_text(i, piece)

    completions, cache = [], SuffixCache() if cache is None else cache
    for start in range(0, len(prompts), batch_size):
        batch = slice(start, start + batch_size)
        out = decode(pair.target, ids[batch], draft=pair.draft, drafter=drafter, cache=cache, verification=verification,
                     sampling=request.sampling, draft_length=draft_length,
                     max_new_tokens=max_new_tokens or max(1, context_room(
                         (pair.target, pair.draft), max(map(len, ids[batch])), draft_length.longest)),
                     eos_token_ids=pair.eos_token_ids,
                     stop=stop_checker(tokenizer, stop),
                     weight_fn=weight_fn, seed=seed + start, profile=profile,
                     on_tokens=None if on_text is None and on_tokens is None else
                     lambda row, new, start=start: stream(start + row, new),
                     predictions=predicted[batch], provenance=provenance)
        for i, (prompt, tokens, stats, origins) in enumerate(zip(prompts[batch], out.tokens, out.stats, out.origins,
                                                                 strict=True), start):
            text = cut_at_stop(tokenizer.decode(tokens, skip_special_tokens=True), stop)
            if on_text is not None and (rest := streams[i].add([], final=True)):
                on_text(i, rest)
            metrics = {**stats.to_dict(), "verification": verification.label} | (
                {"profile": out.profile} if profile else {})
            if predicted[i] is not None:
                accepted, rejected = prediction_tokens(predicted[i], tokens)
                metrics |= {"accepted_prediction_tokens": accepted, "rejected_prediction_tokens": rejected}
            completions.append(Completion(prompt, text, tokens, metrics, records(
                tokenizer, tokens, TokenTexts(tokenizer).add(tokens), origins) if provenance else None))
    return completions


def load_head(pair: Pair, head: str | None = None) -> EnsembleHead:
    """A trained head for this pair (a folder, or the name of a head shipped for the default pair; None: the
    default one), refused if it was trained for other models."""
    draft = pair.draft
    return EnsembleHead.load(head, draft_hidden=None if draft is None else draft.hidden_size,
                             target_hidden=pair.target.hidden_size, draft_model=None if draft is None else
                             pair.draft_name, target_model=pair.target_name).to(pair.target.device)

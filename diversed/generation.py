"""Text in, text out: chat templates, tokenization, batching and stop strings around the decoding loop."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from diversed.admission import admit
from diversed.decoding.drafters import SuffixCache, make_drafter, prediction_tokens
from diversed.decoding.engine import Batch, Job
from diversed.decoding.policy import Head
from diversed.decoding.provenance import records
from diversed.decoding.schedule import CostMemory
from diversed.models.loading import Pair
from diversed.request import DEFAULT_DRAFTING, Drafting, Request, Verification, renamed_keywords
from diversed.text import StreamedText, TokenTexts, cut_at_stop


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


@renamed_keywords(method="verification", weight_fn="head")
def generate(
    pair: Pair,
    prompts: str | Sequence[str | list[dict]],
    *,
    verification: str | Verification = "exact",
    drafter: str = "auto",
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    draft_length: int | None = None,
    drafting: Drafting | None = None,
    max_new_tokens: int | None = None,
    stop: str | Sequence[str] = (),
    chat: bool | None = None,
    system: str | None = None,
    batch_size: int = 1,
    seed: int = 0,
    head: Head | None = None,
    profile: bool = False,
    on_text: Callable[[int, str], None] | None = None,
    on_tokens: Callable[[int, list[int]], None] | None = None,
    cache: SuffixCache | None = None,
    prediction: str | Sequence[str | None] | None = None,
    provenance: bool = False,
    costs: CostMemory | None = None,
    cache_prompt: bool = True,
) -> list[Completion]:
    """Generate a completion for each prompt (a string, or a conversation: chat messages with role and content)
    with the pair and a verification ("plain", "exact", "static:0.7",
    "diversed:HEAD" with a head's folder or a shipped head's name, ...). head: a head or weight function that
    overrides the head of a "diversed" verification (or drives "dynamic").

    drafter: what proposes the drafts (diversed.decoding.drafters): "auto" (each round the fastest of copying
    from the text so far and earlier outputs, the draft model, or none, under the speed schedule), "model",
    "lookup" (prompt lookup), "suffix" (a suffix cache shared by the batches of this call, or `cache`) or
    "prediction" (the request's prediction only).
    draft_length: N drafts a round; drafting: a Drafting (a schedule, a cut-off); neither: the backend's
    default (DEFAULT_DRAFTING).
    chat: wrap each prompt in the tokenizer's chat template (None: whenever the tokenizer has one).
    max_new_tokens: at most so many new tokens; None: until the end of the answer (EOS or a stop string), or
    as many as the models' context leaves after the prompt, as llama.cpp and OpenAI do.
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
    costs: the speed schedule's measured costs to start from and add to (CostMemory; None: this call's own).
    cache_prompt: start from what the backend's prompt cache holds of each prompt (metrics' cached_tokens
    counts it), reading only the rest; False: read every prompt whole.
    """
    request = Request.of(prompts, verification=verification, drafter=drafter, temperature=temperature, top_k=top_k,
                         top_p=top_p, draft_length=draft_length, drafting=drafting, max_new_tokens=max_new_tokens,
                         stop=stop, seed=seed, prediction=prediction, provenance=provenance, chat=chat, system=system,
                         batch_size=batch_size, cache_prompt=cache_prompt)
    heads = None if head is None else {request.verification.head: head}
    return run(pair, request, heads=heads, profile=profile, on_text=on_text, on_tokens=on_tokens, cache=cache,
               costs=costs)


def run(pair: Pair, request: Request, *, heads: Mapping[str | None, Head] | None = None, profile: bool = False,
        on_text: Callable[[int, str], None] | None = None, on_tokens: Callable[[int, list[int]], None] | None = None,
        cache: SuffixCache | None = None, costs: CostMemory | None = None) -> list[Completion]:
    """generate() for a Request built already (the command line builds one before the models load): admitted
    (diversed.admission.admit; heads as there), then decoded request.batch_size prompts at a time."""
    jobs = admit(request, pair, heads)
    tokenizer, stop = pair.tokenizer, request.stop
    drafting = request.drafting or DEFAULT_DRAFTING[pair.backend]
    streams = [StreamedText(tokenizer, stop) for _ in jobs]

    def stream(job: Job, new: list[int]) -> None:
        i = index[id(job)]
        if on_tokens is not None:
            on_tokens(i, new)
        if on_text is not None and (piece := streams[i].add(new)):
            on_text(i, piece)

    index = {id(job): i for i, job in enumerate(jobs)}
    completions, cache = [], SuffixCache() if cache is None else cache
    for start in range(0, len(jobs), request.batch_size):
        batch_jobs = jobs[start:start + request.batch_size]
        drafter = None if request.verification.name == "plain" else \
            make_drafter(request.drafter, pair.draft, capacity=len(batch_jobs), confidence=drafting.confidence,
                         cache=cache)
        batch = Batch(pair.target, drafter, drafting=drafting, eos_token_ids=pair.eos_token_ids,
                      capacity=len(batch_jobs), profile=profile, costs=costs)
        for job in batch_jobs:
            job.on_tokens = None if on_text is None and on_tokens is None else stream
            batch.add(job)
        while batch.jobs:
            batch.step()
        batch.close()
        out = batch.generation(batch_jobs)
        for i, (job, stats, origins) in enumerate(zip(batch_jobs, out.stats, out.origins, strict=True), start):
            text = cut_at_stop(tokenizer.decode(job.tokens, skip_special_tokens=True), stop)
            if on_text is not None and (rest := streams[i].add([], final=True)):
                on_text(i, rest)
            metrics = {**stats.to_dict(), "verification": request.verification.label} | (
                {"profile": out.profile} if profile else {})
            if job.prediction is not None:
                accepted, rejected = prediction_tokens(job.prediction, job.tokens)
                metrics |= {"accepted_prediction_tokens": accepted, "rejected_prediction_tokens": rejected}
            completions.append(Completion(request.prompts[i], text, job.tokens, metrics, records(
                tokenizer, job.tokens, TokenTexts(tokenizer).add(job.tokens), origins) if request.provenance
                else None))
    return completions

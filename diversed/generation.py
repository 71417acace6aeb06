"""Text in, text out: chat templates, tokenization, batching and stop strings around the decoding loop."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from diversed.decoding.engine import StopFn, WeightFn, decode
from diversed.decoding.method import Method
from diversed.decoding.sampling import Sampling
from diversed.decoding.schedule import DEFAULT_DRAFTING, DraftLength
from diversed.head.model import PRETRAINED_HEAD, EnsembleHead
from diversed.models.loading import Pair


@dataclass
class Completion:
    """One prompt's generated text, its new token ids and its metrics (diversed.decoding.metrics)."""

    prompt: str
    text: str
    tokens: list[int]
    metrics: dict

    def to_dict(self) -> dict:
        """The JSON form: text and the headline metrics at the top level, all metrics under "metrics"."""
        headline = {k: self.metrics[k] for k in ("new_tokens", "wall_time", "acceptance_rate", "tau",
                                                  "tokens_per_s")}
        return {"prompt": self.prompt, "text": self.text, **headline, "metrics": self.metrics}


def generate(
    pair: Pair,
    prompts: str | Sequence[str],
    *,
    method: str | Method = "exact",
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    draft_length: int | DraftLength | None = None,
    max_new_tokens: int = 128,
    stop: Sequence[str] = (),
    chat: bool | None = None,
    system: str | None = None,
    batch_size: int = 1,
    seed: int = 0,
    weight_fn: WeightFn | None = None,
    profile: bool = False,
) -> list[Completion]:
    """Generate a completion for each prompt with the pair and a method ("auto", "exact", "static:0.7",
    "diversed:HEAD_DIR", ...). weight_fn overrides the head of a "diversed" method (or drives "dynamic").

    draft_length: N drafts a round, a DraftLength, or None for the backend's default (DEFAULT_DRAFTING).
    chat: wrap each prompt in the tokenizer's chat template (None: whenever the tokenizer has one).
    stop: strings that end a sequence; its text is cut before the first one.
    batch_size: prompts decoded together (each batch's metrics carry its own wall time).
    profile: add metrics["profile"], the seconds per phase of the prompt's batch (exact on a GPU too).
    """
    prompts = [prompts] if isinstance(prompts, str) else list(prompts)
    draft_length = DEFAULT_DRAFTING[pair.backend] if draft_length is None else draft_length
    method = Method.parse(method) if isinstance(method, str) else method
    if method.name == "diversed" and weight_fn is None:
        weight_fn = load_head(pair, method.head)
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    tokenizer = pair.tokenizer
    if chat and tokenizer.chat_template is None:
        raise ValueError(f"the tokenizer of {pair.target_name} has no chat template; pass chat=False")
    ids = [encode_prompt(tokenizer, p, chat, system) for p in prompts]

    completions = []
    for start in range(0, len(prompts), batch_size):
        batch = slice(start, start + batch_size)
        out = decode(pair.target, ids[batch], draft=pair.draft, method=method,
                     sampling=Sampling(temperature, top_k, top_p), draft_length=draft_length,
                     max_new_tokens=max_new_tokens, eos_token_ids=pair.eos_token_ids,
                     stop=stop_checker(tokenizer, stop),
                     weight_fn=weight_fn, seed=seed + start, profile=profile)
        for prompt, tokens, stats in zip(prompts[batch], out.tokens, out.stats, strict=True):
            text = cut_at_stop(tokenizer.decode(tokens, skip_special_tokens=True), stop)
            metrics = {**stats.to_dict(), "method": method.label} | ({"profile": out.profile} if profile else {})
            completions.append(Completion(prompt, text, tokens, metrics))
    return completions


def load_head(pair: Pair, directory: str | None = None) -> EnsembleHead:
    """A trained head for this pair, refused if it was trained for other models. None: the head that ships
    for the default pair (PRETRAINED_HEAD)."""
    return EnsembleHead.load(PRETRAINED_HEAD if directory is None else directory,
                             draft_hidden=pair.draft.hidden_size, target_hidden=pair.target.hidden_size,
                             draft_model=pair.draft_name, target_model=pair.target_name).to(pair.target.device)


def stop_checker(tokenizer, stop: Sequence[str]) -> StopFn | None:
    """A stop function for the decoding loop: true once the decoded new text holds a stop string."""
    return (lambda tokens: any(s in tokenizer.decode(tokens) for s in stop)) if stop else None


def cut_at_stop(text: str, stop: Sequence[str]) -> str:
    """The text before the first stop string."""
    for s in stop:
        text = text.split(s, 1)[0]
    return text


def encode_prompt(tokenizer, prompt: str, chat: bool | None = None, system: str | None = None) -> list[int]:
    """Token ids of a prompt, wrapped in the chat template as a user turn when chat is on (None: whenever
    the tokenizer has a template)."""
    if chat is None:
        chat = tokenizer.chat_template is not None
    if not chat:
        return tokenizer(prompt, add_special_tokens=True)["input_ids"]
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]

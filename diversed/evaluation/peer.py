"""The peer: transformers' own assisted generation, generate(assistant_model=...), on the same pair.

It decodes one sequence at a time (it refuses batches). Its acceptance is counted with forward hooks:
each target forward is one round, each draft forward one drafted token, and every round emits its kept
drafts plus one token, so accepted = new tokens - rounds.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence

import torch
from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList

from diversed.decoding.metrics import SequenceStats
from diversed.models.loading import Pair
from diversed.request import Sampling
from diversed.text import stop_checker


@torch.inference_mode()
def assisted_generate(pair: Pair, prompt: Sequence[int], sampling: Sampling, *, draft_length: int | None,
                      weight: float | None = None, max_new_tokens: int = 128, stop: Sequence[str] = (),
                      seed: int = 0) -> tuple[list[int], SequenceStats]:
    """Generate with transformers' assisted generation; return the new tokens and their statistics.

    draft_length None keeps transformers' defaults (20 drafts, a confidence cut-off of 0.4); a number fixes
    the draft length and turns the cut-off off. weight in (0, 1) is its static ensemble
    (assistant_ensemble_weight, w on the target); None is lossless. stop: strings that end the generation,
    checked as ours checks them (transformers' own stop_strings cannot read every tokenizer).
    """
    if not all(hasattr(m, "model") and hasattr(m.model, "generate") for m in (pair.draft, pair.target)):
        raise ValueError("transformers' assisted generation (the hf-* verifications) needs the pair on the "
                         "transformers backend (--backend transformers)")
    draft, target = pair.draft.model, pair.target.model
    defaults = GenerationConfig()
    # Explicit values throughout: unset ones would be filled from the model's generation config and then
    # transformers' defaults (top_k = 50), sampling from another distribution than ours.
    chosen = (dict(do_sample=False) if sampling.greedy else
              dict(do_sample=True, temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p))
    config = GenerationConfig(max_new_tokens=max_new_tokens, repetition_penalty=1.0, eos_token_id=pair.eos_token_ids,
                              pad_token_id=pair.tokenizer.pad_token_id, assistant_ensemble_weight=weight,
                              **chosen)
    # transformers reads the drafting settings from the assistant's own generation config: set them for
    # this call and put the user's back afterwards.
    assistant_config = draft.generation_config
    draft.generation_config = copy.deepcopy(assistant_config)
    drafting = draft.generation_config
    drafting.num_assistant_tokens = defaults.num_assistant_tokens if draft_length is None else draft_length
    drafting.num_assistant_tokens_schedule = defaults.num_assistant_tokens_schedule
    drafting.assistant_confidence_threshold = defaults.assistant_confidence_threshold if draft_length is None else 0.0
    calls = {"target": 0, "draft": 0}

    def counter(role: str):
        return lambda *_: calls.__setitem__(role, calls[role] + 1)

    hooks = [target.register_forward_hook(counter("target")), draft.register_forward_hook(counter("draft"))]
    ids = torch.tensor([list(prompt)], device=target.device)
    torch.manual_seed(seed)
    try:
        start = time.perf_counter()
        out = target.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=draft,
                              generation_config=config, stopping_criteria=_stop_criteria(pair, stop, ids.shape[1]))
        wall = time.perf_counter() - start
    finally:
        for hook in hooks:
            hook.remove()
        draft.generation_config = assistant_config
    tokens = out[0, ids.shape[1]:].tolist()
    stopped = (check := stop_checker(pair.tokenizer, stop)) is not None and check(tokens, 0) is not None
    stats = SequenceStats(new_tokens=len(tokens), target_forwards=calls["target"], draft_forwards=calls["draft"],
                          drafted=calls["draft"], accepted=max(len(tokens) - calls["target"], 0), wall_time=wall,
                          finish_reason="eos" if tokens and tokens[-1] in pair.eos_token_ids else
                          "stop" if stopped else "length")
    return tokens, stats


def _stop_criteria(pair: Pair, stop: Sequence[str], prompt_length: int) -> StoppingCriteriaList:
    """Our stop strings as a transformers stopping criterion (none when there are none)."""
    check = stop_checker(pair.tokenizer, stop)
    if check is None:
        return StoppingCriteriaList()

    class StopStrings(StoppingCriteria):
        def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
            done = [check(row[prompt_length:].tolist(), 0) is not None for row in input_ids]
            return torch.tensor(done, dtype=torch.bool, device=input_ids.device)

    return StoppingCriteriaList([StopStrings()])

"""From logits to the distributions that drafting and verification use (a request's Sampling), and sampling
from them."""

from __future__ import annotations

import torch
from torch import Tensor

from diversed.request import Sampling
from diversed.verify import draw


def probabilities(sampling: Sampling, logits: Tensor) -> Tensor:
    """float32 probabilities [..., V] from logits [..., V]: temperature, then top-k, then top-p; greedy keeps
    the untempered softmax (its tokens are the argmax)."""
    logits = logits.float()
    if sampling.greedy:
        return torch.softmax(logits, dim=-1)
    logits = logits / sampling.temperature
    if sampling.top_k and sampling.top_k < logits.shape[-1]:
        kth = logits.topk(sampling.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # Drop a token once the mass strictly before it already reaches top_p (the top token always stays).
        drop_sorted = sorted_probs.cumsum(-1) - sorted_probs >= sampling.top_p
        logits = logits.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))
    return torch.softmax(logits, dim=-1)


def sample_tokens(sampling: Sampling, probs: Tensor, generator: torch.Generator | None) -> Tensor:
    """One token per row of probs [B, V] -> [B]."""
    if sampling.greedy:
        return probs.argmax(-1)
    return draw(probs, generator)

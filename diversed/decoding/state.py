"""One model, its KV cache, and which cache slots hold real tokens.

Sequences in a batch advance by different amounts each round. Rather than re-pack caches, every model
call appends the same number of slots to every sequence and marks the ones that do not hold a real token
(left padding of the prompt, rejected drafts that could not be cropped because a neighbour kept them) as
holes. Holes are masked out of attention and skipped by the position ids, so each sequence sees exactly
its own tokens at positions 0, 1, 2, ... as if it ran alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor
from transformers import DynamicCache, PreTrainedModel


@dataclass
class ModelState:
    """A causal LM with a batched KV cache. `valid` [B, L] marks the cache slots that hold real tokens."""

    model: PreTrainedModel
    valid: Tensor
    cache: DynamicCache = field(default_factory=DynamicCache)

    @classmethod
    def empty(cls, model: PreTrainedModel, batch_size: int) -> ModelState:
        device = model.device
        return cls(model, torch.zeros(batch_size, 0, dtype=torch.bool, device=device), DynamicCache())

    @property
    def length(self) -> Tensor:
        """Real tokens seen so far per sequence [B]."""
        return self.valid.sum(-1)

    def feed(self, tokens: Tensor, valid: Tensor, logits_from: int) -> tuple[Tensor, Tensor]:
        """Append `tokens` [B, T] (holes where `valid` is False) to the cache.

        Returns the last-layer hidden states (after the final norm, what feeds the LM head) and the float32
        logits of the slots from index `logits_from` on: [B, T - logits_from, d] and [..., V]. Only those
        slots are projected onto the vocabulary, which is most of a small model's step.
        """
        position_ids = (self.length.unsqueeze(-1) + valid.long().cumsum(-1) - 1).clamp_min(0)
        self.valid = torch.cat([self.valid, valid], dim=-1)
        out = self.model.base_model(input_ids=tokens, attention_mask=self.valid.long(), position_ids=position_ids,
                                    cache=self.cache, use_cache=True)
        hidden = out.last_hidden_state[:, logits_from:]
        logits = self.model.get_output_embeddings()(hidden).float()
        return hidden, logits

    def keep(self, keep: Tensor) -> None:
        """Of the last `keep.shape[1]` slots, keep those marked True; drop the rest.

        In each row, no kept slot may come after a dropped real token (rejected drafts are a suffix): kept
        keys and values were computed attending to earlier slots only, so they stay exact. Slots that were
        holes already may be anywhere. Trailing slots dropped by every sequence are cropped off the cache;
        the others become holes.
        """
        t = keep.shape[1]
        self.valid[:, -t:] &= keep
        used = keep.any(0)
        cut = t - (int(used.nonzero().max()) + 1 if used.any() else 0)
        if cut:
            self.cache.crop(-cut)
            self.valid = self.valid[:, :-cut]

    def select(self, rows: Tensor) -> None:
        """Keep only the sequences at `rows` (finished ones leave the batch so they cost nothing)."""
        self.cache.batch_select_indices(rows)
        self.valid = self.valid[rows]

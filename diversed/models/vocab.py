"""A cheaper draft: its LM head scores only the most frequent tokens (as in FR-Spec, Zhao et al. 2025).

The draft's projection onto a 151,936-token vocabulary is about half of a 0.5B model's decoding step on a
CPU. Restricted to the K most frequent tokens, the draft is simply another draft model, one that never
proposes the others (probability 0): verification stays exactly as lossless as before, and only the
acceptance can drop, at positions where the target wants a rare token.

Which tokens: the K lowest ids, plus the special tokens. Byte-level BPE tokenizers (GPT-2, Llama 3, Qwen)
number tokens in merge order, most frequent merges first, so low ids are the common tokens; for other
tokenizers this is a weaker guess, which costs acceptance, never correctness.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from transformers import PreTrainedModel, PreTrainedTokenizerBase


class VocabSubsetHead(nn.Module):
    """An LM head that scores only the token ids in `keep`; every other id gets logit -inf."""

    def __init__(self, head: nn.Linear, keep: Tensor) -> None:
        super().__init__()
        self.in_features, self.out_features = head.in_features, head.out_features
        self.proj = nn.Linear(head.in_features, len(keep), bias=head.bias is not None,
                              dtype=head.weight.dtype, device=head.weight.device)
        with torch.no_grad():
            self.proj.weight.copy_(head.weight[keep])
            if head.bias is not None:
                self.proj.bias.copy_(head.bias[keep])
        self.register_buffer("keep", keep.to(head.weight.device), persistent=False)

    def forward(self, hidden: Tensor) -> Tensor:
        scores = self.proj(hidden)
        logits = scores.new_full((*scores.shape[:-1], self.out_features), float("-inf"))
        return logits.index_copy_(-1, self.keep, scores)


def frequent_token_ids(tokenizer: PreTrainedTokenizerBase, count: int, vocab_size: int) -> Tensor:
    """The `count` lowest token ids and every special token id, sorted, all below vocab_size."""
    if count < 1:
        raise ValueError(f"the draft vocabulary must keep at least 1 token, got {count}")
    special = [i for i in tokenizer.all_special_ids if i is not None]
    special += [i for i in tokenizer.added_tokens_decoder if i is not None]
    ids = sorted({*range(min(count, vocab_size)), *(i for i in special if 0 <= i < vocab_size)})
    return torch.tensor(ids, dtype=torch.long)


def restrict_draft_vocab(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, count: int
                         ) -> PreTrainedModel:
    """Give the draft model an LM head over its `count` most frequent tokens (see the module docstring), in
    place. Must run before diversed.models.onednn converts the linear layers."""
    head = model.get_output_embeddings()
    if type(head) is not nn.Linear:
        raise ValueError(f"cannot restrict the vocabulary of an LM head of type {type(head).__name__}")
    model.set_output_embeddings(VocabSubsetHead(head, frequent_token_ids(tokenizer, count, head.out_features)))
    return model

"""Tiny randomly initialised models, a word-level tokenizer and a toy task, shared by the tests (and by
the torchrun worker, which runs outside pytest)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    Olmo2Config,
    Olmo2ForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from diversed.models.loading import Pair
from diversed.tasks import Example

WORDS = 40
DRAFT_FAVOURED = range(20, 40)  # the toy draft leans to these tokens, the toy target to 2..19


def tiny_model(seed: int, layers: int = 2, vocab: int = 97, hidden: int = 64, arch: str = "qwen2"
               ) -> PreTrainedModel:
    """A random causal LM. "olmo2" for models saved with the word tokenizer: transformers pairs a "qwen2"
    folder with Qwen2's own tokenizer class, which cannot read a word-level tokenizer.json."""
    torch.manual_seed(seed)
    classes = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "olmo2": (Olmo2Config, Olmo2ForCausalLM)}
    config_class, model_class = classes[arch]
    config = config_class(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                          num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                          max_position_embeddings=256, pad_token_id=0, bos_token_id=None, eos_token_id=1)
    model = model_class(config).eval()
    # Sharpen the random logits so greedy choices are far from ties and sampling is not uniform.
    model.lm_head.weight.data *= 8
    return model


def perturbed(model: PreTrainedModel, scale: float, seed: int) -> PreTrainedModel:
    """A draft that agrees with the target often but not always."""
    draft = type(model)(model.config).eval()
    draft.load_state_dict(model.state_dict())
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(scale * torch.randn_like(p) * p.abs().mean())
    return draft


def word_tokenizer() -> PreTrainedTokenizerFast:
    """Tokens t0..t39, split on spaces; t1 ends a sequence."""
    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(WORDS)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="t1", pad_token="t0")


def leaning(model: PreTrainedModel, favoured: range, strength: float = 3.0) -> PreTrainedModel:
    """Give the model's LM head a bias towards some tokens, so draft and target clearly differ."""
    head = torch.nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=True)
    head.weight.data = model.lm_head.weight.data / 8
    head.bias.data.zero_()
    head.bias.data[list(favoured)] = strength
    model.lm_head = head
    return model


def toy_pair() -> Pair:
    target = leaning(tiny_model(0, vocab=WORDS, hidden=32), range(2, 20))
    draft = leaning(tiny_model(3, vocab=WORDS, hidden=48), DRAFT_FAVOURED)
    return Pair(draft, target, word_tokenizer(), "tiny-draft", "tiny-target")


def share_of_draft_tokens(text: str) -> float:
    words = text.split()
    return sum(int(w[1:]) in DRAFT_FAVOURED for w in words) / max(len(words), 1)


@dataclass
class ToyTask:
    """`size` prompts and a reward computed from the completion's text."""

    score: Callable[[str], float]
    size: int = 6
    name: str = "toy"
    metric: str = "share"
    stop: tuple = ()
    max_new_tokens: int = 12

    def examples(self, split: str = "train", limit: int | None = None) -> list[Example]:
        return [Example(f"toy/{i}", f"t{3 + i % 15} t{9 + i % 11} t{15 + i % 5}") for i in range(self.size)][:limit]

    def reward(self, example: Example, completion: str) -> float:
        return self.score(completion)

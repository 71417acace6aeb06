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


def save_tiny_pair(target: PreTrainedModel, root) -> dict[str, str]:
    """Save `target` and a close draft of it, each with the word tokenizer, as Hugging Face folders under
    root; their paths by role."""
    paths = {}
    for role, model in (("target", target), ("draft", perturbed(target, 0.05, 1))):
        model.save_pretrained(root / role)
        word_tokenizer().save_pretrained(root / role)
        paths[role] = str(root / role)
    return paths


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


# GGUF tensor names of a Qwen2 layer's parts, as llama.cpp reads them.
_GGUF_PARTS = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
_GGUF_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
               "lm_head.weight": "output.weight"}
def gguf_tokens(vocab: int) -> list[str]:
    """A byte-level BPE vocabulary of `vocab` tokens: space (GPT-2's "Ġ") and the printable ASCII characters
    from "!", two spaces (for the one merge llama.cpp insists on), then two special tokens, the last EOS.
    transformers reads it back from a GGUF as a tokenizer of (nearly) single characters."""
    characters = ["Ġ"] + [chr(c) for c in range(33, 127)]
    assert 4 <= vocab <= len(characters) + 3
    return characters[:vocab - 3] + ["ĠĠ", "<|endoftext|>", "<|im_end|>"]


def tiny_gguf(model: PreTrainedModel, path, tokens: list[str] | None = None) -> str:
    """Write a tiny Qwen2 model (no LM-head bias) as a float32 GGUF that llama.cpp loads, with the gguf
    package; `tokens` (default gguf_tokens(vocab)) as its byte-level BPE vocabulary."""
    import gguf

    config = model.config
    tokens = gguf_tokens(config.vocab_size) if tokens is None else tokens
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t.startswith("<|") else gguf.TokenType.NORMAL
                            for t in tokens])
    writer.add_token_merges(["Ġ Ġ"])
    writer.add_eos_token_id(len(tokens) - 1)
    writer.add_pad_token_id(len(tokens) - 2)
    for key, value in model.state_dict().items():
        if key in _GGUF_NAMES:
            name = _GGUF_NAMES[key]
        else:
            _, _, layer, *part, kind = key.split(".")
            name = f"blk.{layer}.{_GGUF_PARTS['.'.join(part)]}.{kind}"
        writer.add_tensor(name, value.detach().float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)

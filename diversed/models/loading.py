"""Loading a draft/target pair that shares one tokenizer."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from diversed.models.default_pair import cache_dir, prepare_default_pair
from diversed.models.gguf import convert_gguf
from diversed.models.onednn import use_onednn_linears
from diversed.models.quantize import quantize_linears
from diversed.models.vocab import restrict_draft_vocab

# "float16" on a CPU: float16 weights in the linear layers, float32 arithmetic (diversed.models.quantize;
# CPUs have no fast float16 arithmetic); elsewhere a float16 model.
DTYPES = {"float16": torch.float16, "float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class Pair:
    """A frozen draft and target model with their shared tokenizer."""

    draft: PreTrainedModel
    target: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    draft_name: str
    target_name: str

    @property
    def eos_token_ids(self) -> list[int]:
        """Every token that ends a sequence: the tokenizer's EOS and the target's generation config's."""
        ids = {self.tokenizer.eos_token_id}
        configured = getattr(self.target.generation_config, "eos_token_id", None)
        ids.update(configured if isinstance(configured, list) else [configured])
        return sorted(i for i in ids if i is not None)


def load_pair(draft: str | None = None, target: str | None = None, *, dtype: str = "float16",
              device: str = "cpu", onednn: bool = True, draft_vocab: int | None = None,
              draft_int8: bool = True) -> Pair:
    """Load a draft and a target: hub ids, local folders or .gguf files; the built-in default pair
    (Qwen2.5-Coder 0.5B/1.5B-Instruct, offline) when neither is named. dtype: "float16" (default; on a
    CPU, float16 weights with float32 arithmetic, the fastest here and within 1e-4 of float32's next-token
    distributions), "float32" (the reference) or "bfloat16". onednn: run the linear layers of float32 CPU
    models with oneDNN (diversed.models.onednn), about 1.5-2x faster here than nn.Linear. draft_vocab: let
    the draft score only its most frequent tokens (diversed.models.vocab): a cheaper draft, still lossless.
    draft_int8: run a CPU draft's linear layers in dynamic int8 (diversed.models.quantize): a draft step
    about 1.4x cheaper than float16 weights here, at some acceptance; lossless verification still writes
    what the target would.

    Raises ValueError if only one is named or if their tokenizers differ.
    """
    if (draft is None) != (target is None):
        raise ValueError("name both --draft and --target, or neither for the built-in default pair")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {tuple(DTYPES)}, got {dtype!r}")
    if draft is None:
        draft_dir, target_dir = prepare_default_pair()
        draft, target = str(draft_dir), str(target_dir)
    draft_tokenizer, draft_model = load_model(draft, dtype=dtype, device=device, onednn=onednn, vocab=draft_vocab,
                                              int8=draft_int8)
    target_tokenizer, target_model = load_model(target, dtype=dtype, device=device, onednn=onednn)
    check_same_tokenizer(draft_tokenizer, target_tokenizer, draft, target)
    return Pair(draft_model, target_model, target_tokenizer, _name(draft), _name(target))


def load_model(name: str, *, dtype: str = "float16", device: str = "cpu", onednn: bool = True,
               vocab: int | None = None, int8: bool = False) -> tuple[PreTrainedTokenizerBase, PreTrainedModel]:
    """Tokenizer and frozen eval-mode model from a hub id, a local folder or a .gguf file (converted once
    into the cache, since dequantizing a GGUF takes tens of seconds and a converted copy loads in seconds).
    vocab: score only the `vocab` most frequent tokens (diversed.models.vocab; for drafts).
    int8: dynamic-int8 linear layers for a float32 or float16 CPU model (diversed.models.quantize; for drafts)."""
    if name.endswith(".gguf"):
        path = Path(name)
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {path}")
        # Keyed by path, size and modification time: a changed file is converted again.
        stat = path.stat()
        key = f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
        digest = hashlib.sha256(key.encode()).hexdigest()[:12]
        name = str(convert_gguf(path, cache_dir() / "gguf" / f"{path.stem}-{digest}"))
    tokenizer = AutoTokenizer.from_pretrained(name)
    on_cpu = torch.device(device).type == "cpu"
    cpu_float16 = dtype == "float16" and on_cpu
    model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32 if cpu_float16 else DTYPES[dtype])
    model = model.to(device).eval()
    model.requires_grad_(False)
    if vocab is not None:
        restrict_draft_vocab(model, tokenizer, vocab)
    if int8:
        quantize_linears(model, "int8")
    elif cpu_float16:
        quantize_linears(model, "float16")
    if onednn and dtype == "float32" and on_cpu:
        use_onednn_linears(model)
    return tokenizer, model


def check_same_tokenizer(a: PreTrainedTokenizerBase, b: PreTrainedTokenizerBase, a_name: str, b_name: str
                         ) -> None:
    """Speculative decoding compares token ids across models: refuse a pair whose vocabularies differ."""
    vocab_a, vocab_b = a.get_vocab(), b.get_vocab()
    if vocab_a != vocab_b:
        differing = len(set(vocab_a.items()) ^ set(vocab_b.items()))
        raise ValueError(f"draft and target tokenizers differ: {a_name} has {len(vocab_a)} tokens "
                         f"({type(a).__name__}), {b_name} has {len(vocab_b)} ({type(b).__name__}); "
                         f"{differing} token/id entries disagree. Speculative decoding needs one tokenizer.")


def _name(path_or_id: str) -> str:
    path = Path(path_or_id)
    return path.name if path.exists() else path_or_id

"""Loading a draft/target pair that shares one tokenizer, on a backend (diversed.backends)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from diversed.backends import DEFAULT_CACHE_MIB, Model, as_model
from diversed.models.default_pair import (
    DEFAULT_DRAFT,
    DEFAULT_TARGET,
    cache_dir,
    default_draft_gguf,
    default_gguf,
    prepare_default_pair,
)
from diversed.models.gguf import convert_gguf
from diversed.models.onednn import use_onednn_linears
from diversed.models.options import DTYPE_NAMES, check_load_options
from diversed.models.quantize import quantize_linears
from diversed.models.vocab import restrict_draft_vocab

# "float16" on a CPU: float16 weights in the linear layers, float32 arithmetic (diversed.models.quantize;
# CPUs have no fast float16 arithmetic); elsewhere a float16 model.
DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}


@dataclass
class Pair:
    """A frozen draft and target model (backend models, diversed.backends; transformers models are wrapped)
    with their shared tokenizer."""

    draft: Model
    target: Model
    tokenizer: PreTrainedTokenizerBase
    draft_name: str
    target_name: str

    def __post_init__(self) -> None:
        self.draft, self.target = as_model(self.draft), as_model(self.target)

    @property
    def backend(self) -> str:
        """The engine both models run on: "transformers" or "llama.cpp"."""
        return self.target.backend

    @property
    def eos_token_ids(self) -> list[int]:
        """Every token that ends a sequence: the tokenizer's EOS and the target's own."""
        ids = {self.tokenizer.eos_token_id, *self.target.eos_token_ids}
        return sorted(i for i in ids if i is not None)



def load_pair(draft: str | None = None, target: str | None = None, *, backend: str | None = None,
              dtype: str = "float16", device: str = "cpu", onednn: bool = True, draft_vocab: int | None = None,
              draft_int8: bool = True, threads: int | None = None, draft_quant: str | None = None,
              cache_ram: int | None = None) -> Pair:
    """Load a draft and a target on a backend: "llama.cpp" (.gguf files, run as they are quantized) or
    "transformers" (hub ids, local folders or .gguf files, converted once); None picks default_backend's.
    The built-in default pair (Qwen2.5-Coder 0.5B/1.5B-Instruct, offline) when neither is named.

    llama.cpp: threads, for both models (default: the machine's cores); draft_quant: the default pair's draft
    requantized to "Q3_K_S" or "Q2_K" (a cheaper draft step; made once). Both: cache_ram, each model's prompt
    cache, MiB of KV memory (0: none; default: diversed.backends.prompt_cache.DEFAULT_CACHE_MIB; transformers
    keeps it in host memory). The options below are the transformers backend's: draft_vocab is refused on
    llama.cpp, and dtype, onednn and draft_int8 do not apply there (the GGUF files run as they are quantized).
    transformers: dtype: "float16" (default; on a
    CPU, float16 weights with float32 arithmetic, the fastest here and within 1e-4 of float32's next-token
    distributions), "float32" (the reference) or "bfloat16". onednn: run the linear layers of float32 CPU
    models with oneDNN (diversed.models.onednn), faster on a CPU than nn.Linear. draft_vocab: let
    the draft score only its most frequent tokens (diversed.models.vocab): a cheaper draft, still lossless.
    draft_int8: run a CPU draft's linear layers in dynamic int8 (diversed.models.quantize): a cheaper draft
    step than float16 weights, at some acceptance; lossless verification still writes
    what the target would.

    Raises ValueError if only one is named, if their tokenizers differ, or for options the backend lacks.
    """
    backend = check_load_options(draft, target, backend=backend, dtype=dtype, device=device,
                                 draft_vocab=draft_vocab, threads=threads, draft_quant=draft_quant,
                                 cache_ram=cache_ram)
    if backend == "llama.cpp":
        return _load_llama_cpp_pair(draft, target, threads=threads, draft_quant=draft_quant, cache_ram=cache_ram)
    if draft is None:
        draft_dir, target_dir = prepare_default_pair()
        draft, target = str(draft_dir), str(target_dir)
    draft_tokenizer, draft_model = load_model(draft, dtype=dtype, device=device, onednn=onednn, vocab=draft_vocab,
                                              int8=draft_int8)
    target_tokenizer, target_model = load_model(target, dtype=dtype, device=device, onednn=onednn)
    check_same_tokenizer(draft_tokenizer, target_tokenizer, draft, target)
    draft_name, target_name = _name(draft), _name(target)
    cache_mib = DEFAULT_CACHE_MIB if cache_ram is None else cache_ram
    return Pair(as_model(draft_model, draft_name, cache_mib), as_model(target_model, target_name, cache_mib),
                target_tokenizer, draft_name, target_name)


def _load_llama_cpp_pair(draft: str | None, target: str | None, *, threads: int | None,
                         draft_quant: str | None, cache_ram: int | None) -> Pair:
    from diversed.backends.llama_cpp import LlamaCppModel

    if draft is None:
        paths = (default_draft_gguf(draft_quant), default_gguf(DEFAULT_TARGET))
        names = (DEFAULT_DRAFT.name, DEFAULT_TARGET.name)
        # The converted folders hold the same tokenizer and load it in a second; the GGUF takes longer.
        folders = [cache_dir() / name for name in names]
        tokenizers = [_tokenizer(f) if f.is_dir() else _gguf_tokenizer(p) for f, p in zip(folders, paths, strict=True)]
    else:
        paths = tuple(Path(name).expanduser() for name in (draft, target))
        names = tuple(_name(str(p)) for p in paths)
        tokenizers = [_gguf_tokenizer(p) for p in paths]
    check_same_tokenizer(*tokenizers, str(paths[0]), str(paths[1]))
    cache_mib = DEFAULT_CACHE_MIB if cache_ram is None else cache_ram
    draft_model = LlamaCppModel(paths[0], name=names[0], threads=threads, cache_mib=cache_mib)
    target_model = LlamaCppModel(paths[1], name=names[1], threads=threads, cache_mib=cache_mib)
    return Pair(draft_model, target_model, tokenizers[1], names[0], names[1])


def _tokenizer(folder: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(folder)


def _gguf_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    try:
        return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    except Exception as error:  # a damaged file fails deep in the GGUF reader
        raise ValueError(f"cannot read the tokenizer of {path} ({type(error).__name__}: {error}); is it a "
                         "complete GGUF file?") from error


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
    on_cpu = torch.device(device).type == "cpu"
    cpu_float16 = dtype == "float16" and on_cpu
    try:
        tokenizer = AutoTokenizer.from_pretrained(name)
        model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32 if cpu_float16 else DTYPES[dtype])
    except Exception as error:  # transformers, safetensors and the hub client each raise their own types
        where = "the folder" if Path(name).is_dir() else "the Hugging Face hub (offline?)"
        raise ValueError(f"cannot load the model {name!r} from {where}: {type(error).__name__}: "
                         f"{str(error).splitlines()[0] if str(error) else ''}") from error
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
    """A model's name for heads and reports: a folder's name, a GGUF file's stem (so that the default pair
    has the same names on both backends), or the hub id."""
    path = Path(path_or_id)
    if not path.exists():
        return path_or_id
    return path.stem if path.suffix == ".gguf" else path.name

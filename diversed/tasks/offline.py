"""The benchmark data that ships inside the package (diversed/tasks/data/<data set>/), read with its sha256 checked.

Each data set's folder holds its files gzipped (NAME.gz), their licenses, and manifest.json: provenance and,
per file, the sha256 of the uncompressed NAME. read_text refuses a file whose contents do not match.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import zlib
from collections.abc import Collection
from pathlib import Path

DATA_DIR = Path(__file__).with_name("data")


def read_text(dataset: str, name: str, root: Path = DATA_DIR) -> str:
    """The text of file name of a packaged data set (stored as root/dataset/name.gz), checked against the
    sha256 that root/dataset/manifest.json gives for it. A mismatch or a damaged file raises ValueError."""
    folder = Path(root) / dataset
    path = folder / f"{name}.gz"
    expected = json.loads((folder / "manifest.json").read_text(encoding="utf-8"))["files"][name]["sha256"]
    try:
        data = gzip.decompress(path.read_bytes())
    except (OSError, EOFError, zlib.error) as e:  # not gzip, truncated, or a bad checksum
        raise ValueError(f"{path}: damaged, cannot be decompressed ({e})") from None
    actual = hashlib.sha256(data).hexdigest()
    if actual != expected:
        raise ValueError(f"{path}: sha256 of the uncompressed contents is {actual}, expected {expected} "
                         f"(from {folder / 'manifest.json'})")
    return data.decode("utf-8")


def check_split(split: str, splits: Collection[str]) -> None:
    """Refuse a split the data set does not have (never fall back to another one)."""
    if split not in splits:
        raise ValueError(f"unknown split {split!r}: choose from {sorted(splits)}")

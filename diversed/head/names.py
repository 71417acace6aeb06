"""The heads a user can name before anything loads: the architectures, the heads shipped for the default pair,
and where a named head's files are (imports no torch)."""

from __future__ import annotations

from pathlib import Path

ARCHITECTURES = ("linear", "mlp")
# What a head sets per drafted token (diversed.head.model): the mixture weight w of rule "dynamic" (the paper's
# head), or the lenience L of rule "lossy", bounded by a maximum below 1, read from the target and the draft
# distribution or from the target alone ("lenience-target", for any drafter, copied drafts included).
KINDS = ("mixture", "lenience", "lenience-target")
TARGET_ONLY = "lenience-target"
WEIGHTS_FILE, CONFIG_FILE = "head.safetensors", "head.json"
# Heads trained for the default pair, shipped with the package by name (the task, or the task and a dash); each
# folder's README.md says how it was trained and what it scored on held-out problems. The default, used when
# none is named, is the mixture head with held-out evidence above the static ensemble (gsm8k); gsm8k-lenience
# is the bounded lenience head with evidence above the training-free rules at T = 0.7;
# file-edit-lenience-target reads the target alone, so it verifies copied drafts (on the lenience curve there);
# humaneval is the degenerate accept-everything head.
PRETRAINED = Path(__file__).parent / "pretrained"
PRETRAINED_HEADS = ("humaneval", "gsm8k", "mbpp", "gsm8k-lenience", "file-edit-lenience-target")
DEFAULT_HEAD = "gsm8k"


def head_folder(head: str | Path | None = None) -> Path:
    """Where a head is: the name of a shipped head (PRETRAINED_HEADS, which win over a folder of that name:
    write ./gsm8k for the folder), a folder, or None for the default head. Only looks at the files, so it is
    cheap enough to run before any model loads; FileNotFoundError if the folder holds no head."""
    folder = PRETRAINED / str(head or DEFAULT_HEAD) if head is None or str(head) in PRETRAINED_HEADS else Path(head)
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if not (folder / name).is_file():
            raise FileNotFoundError(f"no head checkpoint in {folder}: {name} is missing (a head is a folder with "
                                    f"{CONFIG_FILE} and {WEIGHTS_FILE}, or a shipped head: "
                                    f"{', '.join(PRETRAINED_HEADS)})")
    return folder

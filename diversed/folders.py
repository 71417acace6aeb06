"""Checks shared by the long runs that write into a folder and resume from it (training, evaluation)."""

from __future__ import annotations

from pathlib import Path


def check_writable(out_dir: Path, what: str) -> None:
    """Refuse an out_dir that is, or lies under, an existing file: mkdir would fail only after the models
    loaded. `what` names the run in the message ("the evaluation", "the training run")."""
    for path in (out_dir, *out_dir.parents):
        if path.exists():
            if not path.is_dir():
                raise ValueError(f"cannot write {what} to {out_dir}: {path} is a file, not a folder")
            return


# Settings renamed since runs were saved: a saved run's old name reads as the new one.
RENAMED_SETTINGS = {"draft_len": "draft_length"}


def saved_settings(saved: dict) -> dict:
    """A saved run's settings under today's names (RENAMED_SETTINGS)."""
    return {RENAMED_SETTINGS.get(name, name): value for name, value in saved.items()}


def changed_settings(saved: dict, current: dict) -> list[str]:
    """The names of the settings whose values differ between a saved run's and this call's, sorted."""
    return sorted(k for k in saved.keys() | current.keys() if saved.get(k) != current.get(k))

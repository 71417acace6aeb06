"""Backends: the engines that run a model (transformers, llama.cpp) behind one interface (base.py)."""

from __future__ import annotations

from diversed.backends.base import Model, Rows
from diversed.backends.prompt_cache import DEFAULT_CACHE_MIB


def as_model(model, name: str = "", cache_mib: int = DEFAULT_CACHE_MIB) -> Model:
    """A backend Model as it is, or a transformers PreTrainedModel wrapped in the transformers backend (with a
    prompt cache of `cache_mib` MiB)."""
    if hasattr(model, "rows"):
        return model
    from diversed.backends.hf import TransformersModel

    return TransformersModel(model, name, cache_mib)


__all__ = ["DEFAULT_CACHE_MIB", "Model", "Rows", "as_model"]

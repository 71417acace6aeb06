"""Backends: the engines that run a model (transformers, llama.cpp) behind one interface (base.py)."""

from __future__ import annotations

from diversed.backends.base import Model, Rows


def as_model(model, name: str = "") -> Model:
    """A backend Model as it is, or a transformers PreTrainedModel wrapped in the transformers backend."""
    if hasattr(model, "rows"):
        return model
    from diversed.backends.hf import TransformersModel

    return TransformersModel(model, name)


__all__ = ["Model", "Rows", "as_model"]

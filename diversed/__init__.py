"""diversed: relaxed speculative decoding with learned dynamic ensemble verification (arXiv 2604.07622).

generate() is text in, text out; decode() the same on token ids; Batch, Job and Policy the continuous batch
underneath (what `diversed serve` runs, diversed.server); verify() the rules as tensor functions. They load
on first use, so that `import diversed` (and the command line) costs nothing until then."""

from importlib import import_module

_HOMES = {"Batch": "diversed.decoding.engine", "Job": "diversed.decoding.engine", "decode": "diversed.decoding.engine",
          "Verification": "diversed.request", "Policy": "diversed.decoding.policy",
          "Completion": "diversed.generation", "generate": "diversed.generation", "Pair": "diversed.models.loading",
          "load_pair": "diversed.models.loading", "verify": "diversed.verify"}
# Names since renamed: they work for one release more, with a FutureWarning.
_RENAMED = {"Method": "Verification"}

__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name in _RENAMED:
        from diversed.request import warn_renamed

        warn_renamed(f"diversed.{name}", f"diversed.{_RENAMED[name]}")
        name = _RENAMED[name]
    if name not in _HOMES:
        raise AttributeError(f"module 'diversed' has no attribute {name!r}")
    return getattr(import_module(_HOMES[name]), name)

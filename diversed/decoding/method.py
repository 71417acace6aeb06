"""A decoding method: plain target decoding ("auto") or a verification rule with its parameters."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from diversed.verify import RULES, check_parameters

METHODS = ("auto", *RULES, "diversed")

# The one parameter each method takes in the compact "name:value" syntax (e.g. "static:0.7"): its rule's first.
_PARAMETER = {name: rule.parameters[0] for name, rule in RULES.items() if rule.parameters} | {"diversed": "head"}


@dataclass(frozen=True)
class Method:
    """Which decoding to run: "auto" (the target alone) or a verification rule with its parameters.

    "dynamic" takes its weights from a weight function given to the decoder; "diversed" is "dynamic" with
    the trained head `head`: a folder (diversed.head) or the name of a head shipped for the default pair,
    without one the default head (diversed.head.model.head_folder)."""

    name: str = "exact"
    weight: float | None = None
    lenience: float | None = None
    alpha: float | None = None
    epsilon: float | None = None
    delta: float | None = None
    head: str | None = None

    def __post_init__(self) -> None:
        if self.name not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.name!r}")
        if self.rule not in (None, "dynamic"):
            check_parameters(self.rule, **self.verify_params())

    @classmethod
    def parse(cls, text: str) -> Method:
        """'auto', 'exact', 'static:0.7', 'lossy:0.3', 'cascade-opt:0.2', 'typical:0.09', 'diversed:DIR'."""
        name, _, value = text.partition(":")
        if not value:
            return cls(name)
        if name not in _PARAMETER:
            raise ValueError(f"method {name!r} takes no parameter, got {text!r}")
        key = _PARAMETER[name]
        try:
            return cls(name, **{key: value if key == "head" else float(value)})
        except ValueError as err:
            raise ValueError(f"cannot read method {text!r}: {err}") from None

    @property
    def rule(self) -> str | None:
        """The rule passed to diversed.verify.verify (None for plain decoding)."""
        return {"auto": None, "diversed": "dynamic"}.get(self.name, self.name)

    @property
    def label(self) -> str:
        value = getattr(self, _PARAMETER.get(self.name, "name"))
        return self.name if value is None or self.name not in _PARAMETER else f"{self.name}:{value}"

    def verify_params(self) -> dict:
        """The keyword arguments of verify() that this method sets."""
        return {k: v for k, v in asdict(self).items() if k not in ("name", "head") and v is not None}

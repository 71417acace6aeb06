"""A decoding method: plain target decoding ("auto") or a verification rule with its parameters."""

from __future__ import annotations

import math
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
    without one the default head (diversed.head.model.head_folder). `shift`, for "diversed" only, is the
    strictness dial of a head: it is added to the head's logit, w = sigmoid(logit(w_head) + shift), so +1 is
    stricter everywhere (more weight on the target) and -1 more lenient, while the head's ranking of tokens
    stays; spelled "diversed:HEAD@+1"."""

    name: str = "exact"
    weight: float | None = None
    lenience: float | None = None
    alpha: float | None = None
    epsilon: float | None = None
    delta: float | None = None
    head: str | None = None
    shift: float | None = None

    def __post_init__(self) -> None:
        if self.name not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.name!r}")
        if self.shift is not None and (self.name != "diversed" or not math.isfinite(self.shift)):
            raise ValueError(f"a head's shift is for method 'diversed' and a finite number of logits, "
                             f"got {self.shift!r} for {self.name!r}")
        if self.rule not in (None, "dynamic"):
            check_parameters(self.rule, **self.verify_params())
        elif given := self.verify_params():  # the target alone verifies nothing; a head gives every weight
            raise ValueError(f"method {self.name!r} takes no {', '.join(given)}")

    @classmethod
    def parse(cls, text: str) -> Method:
        """'auto', 'exact', 'static:0.7', 'lossy:0.3', 'cascade-opt:0.2', 'typical:0.09', 'diversed:DIR',
        'diversed:DIR@+1' (the head shifted by +1 logit; 'diversed:@+1': the default head shifted)."""
        name, _, value = text.partition(":")
        if not value or name not in METHODS:
            return cls(name)  # an unknown name is refused as such, whatever follows it
        if name not in _PARAMETER:
            raise ValueError(f"method {name!r} takes no parameter, got {text!r}")
        key = _PARAMETER[name]
        try:
            if key == "head":
                head, shift = _head_and_shift(value)
                return cls(name, head=head, shift=shift)
            return cls(name, **{key: float(value)})
        except ValueError as err:
            raise ValueError(f"cannot read method {text!r}: {err}") from None

    @property
    def rule(self) -> str | None:
        """The rule passed to diversed.verify.verify (None for plain decoding)."""
        return {"auto": None, "diversed": "dynamic"}.get(self.name, self.name)

    @property
    def label(self) -> str:
        value = getattr(self, _PARAMETER.get(self.name, "name"))
        if self.shift is not None:
            return f"{self.name}:{value or ''}@{self.shift:+}".removesuffix(".0")  # every digit: '@+1', '@-0.25'
        return self.name if value is None or self.name not in _PARAMETER else f"{self.name}:{value}"

    def verify_params(self) -> dict:
        """The keyword arguments of verify() that this method sets."""
        return {k: v for k, v in asdict(self).items() if k not in ("name", "head", "shift") and v is not None}


def _head_and_shift(value: str) -> tuple[str | None, float | None]:
    """'DIR@+1' -> ('DIR', 1.0), 'DIR' -> ('DIR', None), '@-0.5' -> (None, -0.5). Only a number after the
    last '@' is a shift, so a folder with '@' in its path is still read as a folder."""
    head, at, shift = value.rpartition("@")
    try:
        return (head or None, float(shift)) if at else (value, None)
    except ValueError:
        return value, None

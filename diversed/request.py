"""What a user asks of a generation, in one home: the Request, which every edge (generate()'s arguments, the
command line, an HTTP body, an evaluation's settings, the vLLM plugin) translates its own words into, and which
checks each of its fields in one function: the verification (a rule with all its parameters, a trained head
with its dial, or the target alone), the sampling, the drafter and the drafting, the length, stop strings,
seed, prediction and provenance. It imports no torch, so the command line and the server refuse a bad request
before anything heavy loads, with an error that names what was wrong.

Every rule is named here once, with its parameters and their ranges (RULE_SPECS); diversed.verify gives each
one its math under the same name.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace


class RequestError(ValueError):
    """A value of a request that cannot be used. `field` is the request's own name for it (generate()'s
    argument: "temperature", "max_new_tokens", "verification", "prompt", ...); the message holds "{}" where the field
    is named, so that each edge says it in its own words (`message_for`): a flag on the command line, a body
    field on the server."""

    def __init__(self, field: str, template: str) -> None:
        self.field, self.template = field, template
        super().__init__(template.replace("{}", field))

    def message_for(self, name: str) -> str:
        return self.template.replace("{}", name)


class ContextTooLong(RequestError):
    """A prompt and its new tokens that do not fit the model's context."""


class HeadNotFound(RequestError):
    """A verification's head that is not there (not loaded by a server, no such folder or shipped head)."""


# The largest float32: the rules compute in float32, where a larger parameter overflows.
_LARGEST = 3.4028234663852886e38


@dataclass(frozen=True)
class Range:
    """A parameter's range: from low to high (infinite: any value finite in float32), each end included unless
    open."""

    low: float
    high: float = math.inf
    low_open: bool = False
    high_open: bool = False

    def __contains__(self, value: float) -> bool:  # NaN is in none, infinity in no range
        above = self.low < value if self.low_open else self.low <= value
        below = value <= _LARGEST if self.high == math.inf else value < self.high if self.high_open else \
            value <= self.high
        return above and below

    @property
    def text(self) -> str:
        """What a refusal says: 'in [0, 1)', 'positive and at most 3.4e+38'."""
        if self.high == math.inf:
            return ("positive" if self.low_open else "non-negative") + f" and at most {_LARGEST:.2g}"
        return f"in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}{')' if self.high_open else ']'}"


_UNIT = Range(0.0, 1.0)
_POSITIVE = Range(0.0, low_open=True)
_NON_NEGATIVE = Range(0.0)


def _check_number(field: str, value, allowed: Range, what: str) -> None:
    """A real number (not a bool, not NaN) in its range."""
    if isinstance(value, bool) or not isinstance(value, int | float) or value not in allowed:
        raise RequestError(field, f"{{}} must be {what}, got {_show(value)}")


def _check_integer(field: str, value, low: int, note: str = "") -> None:
    """An integer (not a bool) from low to below 2**63 (a seed torch takes; any count a request could mean)."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value < 2**63:
        raise RequestError(field, f"{{}} must be an integer >= {low}{note}, got {_show(value)}")


# Medusa's defaults for typical acceptance (posterior threshold 0.09, alpha 0.3).
TYPICAL_EPSILON = 0.09
TYPICAL_DELTA = 0.3
# vLLM's default entropy gate for FLy (fly_entropy_threshold, nats), and JuDi's confidence above which it matches
# strictly (confidence_threshold in the authors' code).
FLY_ENTROPY_THRESHOLD = 0.3
JUDI_MAX_CONFIDENCE = 0.9


@dataclass(frozen=True)
class RuleSpec:
    """A verification rule as a user names it. parameters: the keyword arguments of verify() it takes (the
    first is the one "name:value" sets); defaults: the values of those that may be left out (typical's are
    Medusa's, lossy-entropy's FLy's, judi's JuDi's); ranges: where a parameter's range is not
    PARAMETER_RANGES' (a letter two papers use for different things)."""

    name: str
    summary: str
    parameters: tuple[str, ...] = ()
    defaults: Mapping[str, float] = field(default_factory=dict)
    ranges: Mapping[str, Range] = field(default_factory=dict)

    @property
    def optional(self) -> bool:
        """Whether the name alone is a complete verification: its first parameter has a default ("typical")."""
        return bool(self.parameters) and self.parameters[0] in self.defaults

    def range(self, parameter: str) -> Range:
        """Where a parameter's values may lie: its own range, else PARAMETER_RANGES'."""
        return self.ranges.get(parameter) or PARAMETER_RANGES[parameter]


RULE_SPECS: dict[str, RuleSpec] = {spec.name: spec for spec in (
    RuleSpec("exact", "p: lossless (Leviathan et al., Chen et al.)"),
    RuleSpec("lossy", "accept with min(1, p/((1-l) q)), correct from norm(max(0, p - q))", ("lenience",)),
    RuleSpec("lossy-entropy", "lossy's test where the target is uncertain, H(p) >= h nats (FLy's gate), exact "
             "elsewhere", ("lenience", "entropy_threshold"), defaults={"entropy_threshold": FLY_ENTROPY_THRESHOLD}),
    RuleSpec("static", "w p + (1-w) q, one w", ("weight",)),
    RuleSpec("dynamic", "w_i p + (1-w_i) q, a w per sequence and position (the DIVERSED head)", ("weight",)),
    RuleSpec("cascade-chow", "q if max q >= 1 - a, else p", ("alpha",)),
    RuleSpec("cascade-opt", "q if max q >= max p - a TV(q, p), else p", ("alpha",)),
    RuleSpec("cascade-token", "q on the tokens p rates within (1 - a) of its best, the rest of the mass on p",
             ("alpha",)),
    RuleSpec("cactus", "p with the draft raised to p(x) + sqrt(2 d p(x)(1 - p(x))), the rest scaled down: a KL "
             "budget d (Hao & Mou)", ("delta",), ranges={"delta": _NON_NEGATIVE}),
    RuleSpec("judi", "q where KL(p || q) < eps and max p <= c, else p (JuDi, Sun et al.)",
             ("epsilon", "max_confidence"), defaults={"max_confidence": JUDI_MAX_CONFIDENCE},
             ranges={"epsilon": _NON_NEGATIVE}),
    RuleSpec("typical", "deterministic: accept iff p(x) > min(eps, delta exp(-H(p))) (Medusa)", ("epsilon", "delta"),
             defaults={"epsilon": TYPICAL_EPSILON, "delta": TYPICAL_DELTA}),
)}

# The range of each parameter, by name; a rule's own `ranges` take precedence. A "dynamic" weight is a tensor,
# one w per position: diversed.verify checks those.
PARAMETER_RANGES: dict[str, Range] = {
    "weight": _UNIT,
    "lenience": Range(0.0, 1.0, high_open=True),
    "alpha": _UNIT,
    "epsilon": _POSITIVE,
    "delta": _POSITIVE,
    "entropy_threshold": _NON_NEGATIVE,
    "max_confidence": _UNIT,
}


def check_rule_parameters(rule: str, given: Mapping[str, object]) -> None:
    """ValueError unless `rule` gets exactly its parameters (those without a default all present; None counts
    as absent), each a number in its range (diversed.verify passes a tensor's extremes)."""
    if rule not in RULE_SPECS:
        raise ValueError(f"rule must be one of {tuple(RULE_SPECS)}, got {rule!r}")
    spec = RULE_SPECS[rule]
    for name in spec.parameters:
        if given.get(name) is None and name not in spec.defaults:
            raise ValueError(f"rule {rule!r} needs {name}")
    for name, value in given.items():
        if value is None:
            continue
        if name not in spec.parameters:
            raise ValueError(f"{name} does not apply to rule {rule!r}")
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise ValueError(f"{name} must be a number, got {type(value).__name__} {value!r}")
        allowed = spec.range(name)
        if float(value) not in allowed:
            raise ValueError(f"{name} must be {allowed.text}, got {value!r}")


@dataclass(frozen=True)
class Sampling:
    """Temperature, top-k and top-p, applied to each model's logits separately, before any mixing
    (diversed.decoding.sampling). Temperature 0 means greedy: the distributions stay untempered softmaxes and
    tokens are their argmax."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        _check_number("temperature", self.temperature, Range(0.0), "a finite number >= 0")
        _check_integer("top_k", self.top_k, 0, " (0 = off)")
        _check_number("top_p", self.top_p, Range(0.0, 1.0, low_open=True), "a number in (0, 1]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


VERIFICATIONS = ("plain", *RULE_SPECS, "diversed")
# Old spellings that still work for one release, with a warning. The target alone was verification "auto", the
# name the drafter and the draft schedule use for the speed model's choice each round; it is "plain" now.
RENAMED_VERIFICATIONS = {"auto": "plain"}
# The drafters (diversed.decoding.drafters), one file each: name -> "module.Class" there, in the order the "auto"
# drafter prefers them when they tie. Adding a drafter is its file and its line here. "auto" is none of them: each
# round the fastest of them all (the speed model's choice, or row by row under another schedule).
DRAFTER_CLASSES = {"prediction": "prediction.PredictionDrafter", "lookup": "lookup.LookupDrafter",
                   "suffix": "suffix.SuffixDrafter", "model": "model.ModelDrafter"}
DRAFTERS = ("auto", *DRAFTER_CLASSES)
# How the draft length changes between rounds (Drafting). "speed" was "auto", the drafter's name for its own choice.
SCHEDULES = ("constant", "heuristic", "speed")
RENAMED_SCHEDULES = {"auto": "speed"}


# The parameter each verification's compact "name:value" form sets: its rule's first.
_FIRST = {name: spec.parameters[0] for name, spec in RULE_SPECS.items() if spec.parameters} | {"diversed": "head"}


@dataclass(frozen=True)
class Verification:
    """Which decoding to run: "plain" (the target alone) or a verification rule with its parameters.

    "dynamic" takes its weights from a weight function given to the decoder; "diversed" is "dynamic" with
    the trained head `head`: a folder (diversed.head) or the name of a head shipped for the default pair,
    without one the default head (diversed.head.model.head_folder). `shift`, for "diversed" only, is the
    strictness dial of a head: it is added to the head's logit, w = sigmoid(logit(w_head) + shift), so +1 is
    stricter everywhere (more weight on the target) and -1 more lenient, while the head's ranking of tokens
    stays; spelled "diversed:HEAD@+1". For a lenience head (its L below a maximum L_max) the same dial moves
    L = L_max sigmoid(logit(L_head / L_max) - shift): + is stricter there too."""

    name: str = "exact"
    weight: float | None = None
    lenience: float | None = None
    alpha: float | None = None
    epsilon: float | None = None
    delta: float | None = None
    entropy_threshold: float | None = None
    max_confidence: float | None = None
    head: str | None = None
    shift: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "name", _current_name(self.name))
        if self.name not in VERIFICATIONS:
            raise RequestError("verification", f"{{}} must be one of {VERIFICATIONS}, got {self.name!r}")
        if self.shift is not None and (self.name != "diversed" or not math.isfinite(self.shift)):
            raise RequestError("verification", f"a head's shift is for {{}} 'diversed' and a finite number of "
                                               f"logits, got {self.shift!r} for {self.name!r}")
        if self.rule not in (None, "dynamic"):
            try:
                check_rule_parameters(self.rule, self.verify_params())
            except ValueError as error:
                raise RequestError("verification", f"{{}} {self.name!r}: {error}") from None
        elif given := self.verify_params():  # the target alone verifies nothing; a head gives every weight
            raise RequestError("verification", f"{{}} {self.name!r} takes no {', '.join(given)}")

    @classmethod
    def parse(cls, text: str) -> Verification:
        """'plain', 'exact', 'static:0.7', 'lossy:0.3', 'cascade-opt:0.2', 'typical:0.09', 'diversed:DIR',
        'diversed:DIR@+1' (the head shifted by +1 logit; 'diversed:@+1': the default head shifted); a rule's
        other parameters follow by name: 'lossy-entropy:0.5,entropy_threshold=1.2', 'judi:0.1,max_confidence=0.8',
        'typical:0.09,delta=0.5'."""
        if not isinstance(text, str):
            raise RequestError("verification", f"{{}} must be a string like 'exact' or 'static:0.7', got {_show(text)}")
        name, _, value = text.partition(":")
        name = _current_name(name)
        if name == "dynamic":  # its weights come from a Python function, which no text can name
            raise RequestError("verification", "{} 'dynamic' takes its weights from a Python weight function; name "
                                               "a trained head with 'diversed' or 'diversed:HEAD'")
        if not value or name not in VERIFICATIONS:
            return cls(name)  # an unknown name is refused as such, whatever follows it
        if name not in _FIRST:
            raise RequestError("verification", f"{{}} {name!r} takes no parameter, got {text!r}")
        try:
            if name == "diversed":
                head, shift = _head_and_shift(value)
                return cls(name, head=head, shift=shift)
            first, *rest = value.split(",")
            params = {_FIRST[name]: float(first)}
            for item in rest:
                key, equals, number = item.partition("=")
                if not equals or key.strip() not in RULE_SPECS[name].parameters[1:]:
                    raise ValueError(f"{item!r} is not one of its other parameters as NAME=VALUE "
                                     f"({', '.join(RULE_SPECS[name].parameters[1:]) or 'it has none'})")
                params[key.strip()] = float(number)
            return cls(name, **params)
        except RequestError:  # a value out of its range: it says so itself
            raise
        except ValueError as err:
            raise RequestError("verification", f"cannot read {{}} {text!r}: {err}") from None

    def with_head(self, head: str | None, field: str = "head") -> Verification:
        """This verification with a head named apart from it (the command line's --head, a body's "head"): only
        "diversed" takes one, and one that names a head of its own must name the same."""
        if head is None:
            return self
        if not isinstance(head, str) or not head:
            raise RequestError(field, f"{{}} must be the name of a head, got {_show(head)}")
        if self.name != "diversed" or self.head not in (None, head):
            raise RequestError(field, f"{{}} {head!r} is for verification 'diversed' without a head of its own, not "
                                      f"{self.label!r}")
        return replace(self, head=head)

    @property
    def rule(self) -> str | None:
        """The rule passed to diversed.verify.verify (None for plain decoding)."""
        return {"plain": None, "diversed": "dynamic"}.get(self.name, self.name)

    @property
    def label(self) -> str:
        """The canonical spelling, which parse() reads back: 'static:0.7', 'judi:0.1,max_confidence=0.8'."""
        value = getattr(self, _FIRST.get(self.name, "name"))
        if self.shift is not None:
            return f"{self.name}:{value or ''}@{self.shift:+}".removesuffix(".0")  # every digit: '@+1', '@-0.25'
        if value is None or self.name not in _FIRST:
            return self.name
        spec = RULE_SPECS.get(self.name)
        others = [f"{key}={getattr(self, key)}" for key in (spec.parameters[1:] if spec else ())
                  if getattr(self, key) is not None]
        return ",".join([f"{self.name}:{value}", *others])

    def verify_params(self) -> dict:
        """The keyword arguments of verify() that this verification sets."""
        return {k: v for k, v in asdict(self).items() if k not in ("name", "head", "shift") and v is not None}


def _current_name(name: str) -> str:
    """A verification's name as it is now spelled; an old spelling (RENAMED_VERIFICATIONS) with a warning."""
    if name not in RENAMED_VERIFICATIONS:
        return name
    warn_renamed(f"verification {name!r}", f"{RENAMED_VERIFICATIONS[name]!r} (the target alone)", stacklevel=5)
    return RENAMED_VERIFICATIONS[name]


def warn_renamed(old: str, new: str, *, stacklevel: int = 3) -> None:
    """A FutureWarning that `old` is now spelled `new`: the old spelling works for one release more.
    stacklevel: warnings.warn's, from this function (the default, 3, names the line that called its caller)."""
    warnings.warn(f"{old} is now {new}; {old} stops working in the next release", FutureWarning,
                  stacklevel=stacklevel)


def renamed_keywords(**new_names: str):
    """A decorator: a function's keyword arguments under their old names (old=new) still work for one release,
    with a FutureWarning. On a class, its __init__'s (a dataclass's fields)."""
    def wrap(function):
        if isinstance(function, type):
            function.__init__ = wrap(function.__init__)
            return function
        name = function.__qualname__.removesuffix(".__init__")

        @functools.wraps(function)
        def call(*args, **kwargs):
            for old, new in new_names.items():
                if old in kwargs:
                    if new in kwargs:
                        raise TypeError(f"{name}() got {old}= and {new}=, two spellings of one argument: give {new}=")
                    warn_renamed(f"{name}({old}=)", f"{name}({new}=)")
                    kwargs[new] = kwargs.pop(old)
            return function(*args, **kwargs)
        return call
    return wrap


def _head_and_shift(value: str) -> tuple[str | None, float | None]:
    """'DIR@+1' -> ('DIR', 1.0), 'DIR' -> ('DIR', None), '@-0.5' -> (None, -0.5). Only a number after the
    last '@' is a shift, so a folder with '@' in its path is still read as a folder."""
    head, at, shift = value.rpartition("@")
    try:
        return (head or None, float(shift)) if at else (value, None)
    except ValueError:
        return value, None


@dataclass(frozen=True)
class Drafting:
    """How many tokens each round drafts: the draft length N (`initial`) and its schedule (a request's
    `drafting`; a bare N, `draft_length`, is Drafting(N)).

    constant: N every round. heuristic (transformers' schedule): +2 after a round in which the drafts were
    all kept, -1 (not below 1) otherwise; in a batch, a round counts as fully kept when at least half of the
    sequences kept all their drafts, since the batch shares one N. speed: each round, the N in
    [1, maximum] that the speed model predicts to give the most tokens per second, from this run's measured
    draft step and verify pass times and its running acceptance (see SpeedModel); N is the first round's.
    The speed schedule may also choose N = 0, a step of the target alone, whose token follows the target's
    p whatever the rule (as a bonus token does).
    confidence: a sequence stops drafting in a round once its drafted token had draft probability below
    this (the token itself is still proposed); 0 disables it.
    """

    initial: int = 5
    schedule: str = "constant"
    maximum: int = 16
    confidence: float = 0.0

    def __post_init__(self) -> None:
        _check_integer("draft_length", self.initial, 1)
        _check_integer("draft_length", self.maximum, 1, " (the longest round)")
        _check_number("draft_confidence", self.confidence, Range(0.0, 1.0, high_open=True), "a number in [0, 1)")
        if self.schedule != "constant" and self.initial > self.maximum:
            raise RequestError("draft_length", f"{{}} must be in [1, {self.maximum}], got {self.initial}")
        if self.schedule in RENAMED_SCHEDULES:
            warn_renamed(f"draft schedule {self.schedule!r}", repr(RENAMED_SCHEDULES[self.schedule]), stacklevel=5)
            object.__setattr__(self, "schedule", RENAMED_SCHEDULES[self.schedule])
        if self.schedule not in SCHEDULES:
            raise RequestError("draft_schedule", f"{{}} must be one of {SCHEDULES}, got {self.schedule!r}")

    def __str__(self) -> str:
        """"5", "20, cut-off 0.4", "speed from 5": for tables and headers."""
        length = str(self.initial) if self.schedule == "constant" else f"{self.schedule} from {self.initial}"
        return length + (f", cut-off {self.confidence}" if self.confidence else "")

    @property
    def longest(self) -> int:
        """The longest round this schedule can draft."""
        return self.initial if self.schedule == "constant" else self.maximum

    def next(self, n: int, fully_kept_fraction: float) -> int:
        """The heuristic and constant schedules' draft length of the next round, after a round of length n."""
        if self.schedule == "constant":
            return n
        return min(n + 2, self.maximum) if fully_kept_fraction >= 0.5 else max(n - 1, 1)


# What generate() and `diversed generate` draft by default, per backend (benchmarks/README.md has the runs
# that chose them). transformers: 20 tokens a round, a sequence stopping early once its draft is less than
# 40% sure (transformers' assisted-generation defaults too); the fastest measured on the default pair at
# T = 0 and T = 1. llama.cpp on a CPU: the speed model chooses each round from measured costs, the target
# alone included; up to 64 drafts, since a long copy (a file returned with one change) is kept for dozens of
# tokens and a pass over 64 tokens costs a few over one.
DEFAULT_DRAFTING = {"transformers": Drafting(20, confidence=0.4),
                    "llama.cpp": Drafting(2, "speed", maximum=64, confidence=0.4)}


@dataclass(frozen=True)
class Request:
    """Everything a user asks of one generation, complete and checked: each edge (generate()'s arguments, the
    command line, an HTTP body, an evaluation's settings, the vLLM plugin) only translates its own words into
    one, and everything below trusts it. Each field is checked by one function, whichever edge it came from:
    its own type's (Verification, Sampling, Drafting) or the one named for it below. What needs the loaded
    models (a head, the context, a draft model) is checked when the request is admitted
    (diversed.admission.admit).

    prompts: texts, or conversations (chat messages {"role", "content"}); verification: a Verification or its
    spelling ("static:0.7"); drafter: DRAFTERS; drafting: the draft length and its schedule (None: the
    backend's default, DEFAULT_DRAFTING); max_drafts: at most so many drafts a round for this request (a
    server's client sets it; None: the batch's); max_new_tokens: None until the answer ends or the context
    does; seed: None for a random one; predictions: per prompt, what its answer is expected to repeat
    (Predicted Outputs), or None; provenance: say how each token was made; chat: wrap prompts in the chat
    template (None: where the tokenizer has one); system: a system message for it; batch_size: prompts decoded
    together; cache_prompt: start from what the backend's prompt cache holds of each prompt (llama-server's
    field; False: read it whole)."""

    prompts: tuple[str | list[dict], ...]
    verification: Verification = Verification()
    sampling: Sampling = Sampling()
    drafter: str = "auto"
    drafting: Drafting | None = None
    max_drafts: int | None = None
    max_new_tokens: int | None = None
    stop: tuple[str, ...] = ()
    seed: int | None = 0
    predictions: tuple[str | None, ...] | None = None
    provenance: bool = False
    chat: bool | None = None
    system: str | None = None
    batch_size: int = 1
    cache_prompt: bool = True

    def __post_init__(self) -> None:
        def canonical(name: str, value) -> None:
            object.__setattr__(self, name, value)

        canonical("prompts", _prompts(self.prompts))
        if not isinstance(self.verification, Verification):
            canonical("verification", Verification.parse(self.verification))
        for name, kind in (("sampling", Sampling), ("drafting", Drafting)):
            if not isinstance(getattr(self, name), kind | None) or (name == "sampling" and self.sampling is None):
                raise RequestError(name, f"{{}} must be a {kind.__name__}, got {_show(getattr(self, name))}")
        if self.drafter not in DRAFTERS:
            raise RequestError("drafter", f"{{}} must be one of {DRAFTERS}, got {_show(self.drafter)}")
        for name, low in (("max_drafts", 1), ("max_new_tokens", 1), ("seed", 0), ("batch_size", 1)):
            if getattr(self, name) is not None or name == "batch_size":  # None: the batch's, the end, a random seed
                _check_integer(name, getattr(self, name), low)
        canonical("stop", _stop(self.stop))
        canonical("predictions", _predictions(self.predictions, len(self.prompts), self.verification, self.drafter))
        for name in ("provenance", "chat", "cache_prompt"):
            if not isinstance(getattr(self, name), bool) and (name != "chat" or self.chat is not None):
                raise RequestError(name, f"{{}} must be true or false, got {_show(getattr(self, name))}")
        if self.system is not None:
            _check_text("system", "{}", self.system)
        if self.chat is False and any(isinstance(p, list) for p in self.prompts):
            raise RequestError("chat", "a conversation (chat messages) needs the chat template: not with {} off")

    @classmethod
    def of(cls, prompts: str | Sequence[str | list[dict]], *, verification: str | Verification = "exact",
           drafter: str = "auto", temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
           draft_length: int | None = None, drafting: Drafting | None = None, max_drafts: int | None = None,
           max_new_tokens: int | None = None, stop: str | Sequence[str] = (), seed: int | None = 0,
           prediction: str | Sequence[str | None] | None = None, provenance: bool = False,
           chat: bool | None = None, system: str | None = None, batch_size: int = 1,
           cache_prompt: bool = True) -> Request:
        """generate()'s words: a prompt or a list of them, a verification's spelling, the sampling numbers, the
        drafting as N drafts a round (draft_length) or a Drafting, one prediction for every prompt or one each."""
        return cls(prompts, verification, Sampling(temperature, top_k, top_p), drafter,
                   as_drafting(draft_length, drafting), max_drafts,
                   max_new_tokens, stop, seed, prediction, provenance, chat, system, batch_size, cache_prompt)


def as_drafting(draft_length: int | Drafting | None, drafting: Drafting | None = None) -> Drafting | None:
    """The drafting of N drafts a round (draft_length: Drafting(N)) or `drafting`, whichever is given (None:
    neither). A Drafting passed as draft_length, its name until this release, works with a warning."""
    if isinstance(draft_length, Drafting):
        warn_renamed("draft_length=Drafting(...)", "drafting=Drafting(...)", stacklevel=4)
        draft_length, drafting = None, draft_length if drafting is None else drafting
    if draft_length is not None and drafting is not None:
        raise RequestError("draft_length", "give {} (N drafts a round) or drafting (a Drafting), not both")
    return drafting if draft_length is None else Drafting(draft_length)


def _prompts(prompts) -> tuple[str | list[dict], ...]:
    """A prompt or several, each a non-empty text that UTF-8 can encode or a conversation."""
    prompts = (prompts,) if isinstance(prompts, str) else prompts
    if not isinstance(prompts, Sequence) or not prompts:
        raise RequestError("prompt", f"{{}}s must be a non-empty list of strings, got {_show(prompts)}")
    for number, prompt in enumerate(prompts, 1):
        name = "{}" if len(prompts) == 1 else f"{{}} {number}"
        if isinstance(prompt, list):
            _check_conversation("prompt", name, prompt)
        else:
            _check_text("prompt", name, prompt)
    return tuple(prompts)


def _stop(stop) -> tuple[str, ...]:
    """Stop strings: one, or a list of them, each a non-empty string."""
    stop = (stop,) if isinstance(stop, str) else stop
    if not isinstance(stop, Sequence):
        raise RequestError("stop", f"{{}} must be a string or a list of strings, got {_show(stop)}")
    for number, text in enumerate(stop, 1):
        if not isinstance(text, str) or not text:
            raise RequestError("stop", f"{{}} string {number} must be a non-empty string, got {_show(text)}")
        _check_text("stop", f"{{}} string {number}", text, blank=True)
    return tuple(stop)


def _predictions(prediction, count: int, verification: Verification, drafter: str) -> tuple[str | None, ...]:
    """One prediction per prompt (a string is every prompt's; None: none), and only where it is drafted from:
    by the drafter "auto" or "prediction", for a verification that checks drafts (a mixture head, which
    verifies the draft model's drafts only, is refused once the head is known: diversed.admission)."""
    if prediction is None or isinstance(prediction, str):
        predictions = [prediction] * count
    elif isinstance(prediction, Sequence):
        predictions = list(prediction)
    else:
        raise RequestError("prediction", f"{{}} must be a string, a list of them or None, got {_show(prediction)}")
    if len(predictions) != count:
        raise RequestError("prediction", f"{{}} must be one string for every prompt or a list of one per prompt "
                                         f"({count}), got {len(predictions)}")
    for number, text in enumerate(predictions, 1):
        if text is not None:
            _check_text("prediction", "{}" if count == 1 else f"{{}} {number}", text)
    given = any(text is not None for text in predictions)
    # The target alone drafts nothing, so it needs no prediction whatever the drafter (an evaluation's baseline).
    if drafter == "prediction" and verification.name != "plain" and not all(text is not None for text in predictions):
        raise RequestError("drafter", "{} 'prediction' drafts from a prediction: give one for every prompt")
    if given and drafter not in ("auto", "prediction"):
        raise RequestError("prediction", f"a {{}} is drafted from by drafter 'auto' or 'prediction', not {drafter!r}")
    if given and verification.name == "plain":
        raise RequestError("prediction", "verification 'plain' decodes with the target alone: a {} would go unused")
    return tuple(predictions)


def check_encodable(name: str, text: str) -> None:
    """ValueError naming the input if UTF-8 cannot encode it (a lone surrogate, which JSON and a shell's
    non-UTF-8 bytes can carry): a tokenizer would fail on it later, with a less helpful error."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(f"{name} holds {text[error.start:error.end]!r} at character {error.start}, which is not "
                         "text (a lone surrogate); it cannot be encoded") from None


def _check_text(field: str, name: str, text, blank: bool = False) -> None:
    """A text input (`name`, "{}" for the field) must be a string that UTF-8 can encode (a lone surrogate
    cannot), and not blank unless `blank` allows it."""
    if not isinstance(text, str):
        raise RequestError(field, f"{name} must be a string, got {_show(text)}")
    if not blank and not text.strip():
        raise RequestError(field, f"{name} is empty")
    try:
        check_encodable(name, text)
    except ValueError as error:
        raise RequestError(field, str(error)) from None


def _check_conversation(field: str, name: str, messages: list) -> None:
    """A conversation is a non-empty list of {"role": system|user|assistant, "content": text} objects."""
    if not messages:
        raise RequestError(field, f"{name} is an empty conversation")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or set(message) != {"role", "content"} or \
                message["role"] not in ("system", "user", "assistant"):
            raise RequestError(field, f"{name}, message {i + 1}: must be {{'role': 'system'|'user'|'assistant', "
                                      f"'content': text}}, got {_show(message)}")
        _check_text(field, f"{name}, message {i + 1}", message["content"], blank=True)
    if not any(message["content"].strip() for message in messages):
        raise RequestError(field, f"{name} has no text in any message")


def _show(value) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60] + '...' if len(text) > 60 else text}"


def __getattr__(name: str):
    """Drafting's name until this release, DraftLength, for one release more, with a warning."""
    if name == "DraftLength":
        warn_renamed("diversed.request.DraftLength", "diversed.request.Drafting")
        return Drafting
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

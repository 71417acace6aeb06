"""The DIVERSED heads: per drafted token, from what the verifier sees to the parameter of a rule.

A mixture head (kind "mixture", EnsembleHead, the paper's): input [h_draft ; h_target], the last-layer hidden
states (after the final norm) that produced q_i and p_i; output w_i in (0, 1), the target's share of the
ensemble nu_i = w_i p_i + (1-w_i) q_i (rule "dynamic"). The paper's head is Linear(d_draft + d_target, 2) and a
softmax over (draft, target); a softmax over two logits is a sigmoid of their difference, so one output logit
is the same family without the redundant parameters.

A lenience head (kinds "lenience" and "lenience-target", LenienceHead): output L_i in (0, max_lenience) (at
most max_lenience in float32, where a sigmoid saturates to 1), the lenience of rule "lossy" at that token:
accept with min(1, p(x) / ((1 - L_i) q(x))). Whatever it outputs, the draft can overshoot the target by at
most 1 / (1 - max_lenience) (docs/algorithm.md section 3.1); a mixture puts (1 - w) q on tokens where p is
near 0. Its inputs, decided from the flip study (benchmarks/results/gsm8k-t0.1/flip-head): five numbers any
rule can read at a flip (TV(q, p), the target's confidence, position, kind of token) ranked harmful flips as
well as both hidden states, and adding the hidden states to them added nothing. So
it reads the token's numbers, FEATURES, and of the hidden states only the target's: a verifier sees neither
the position in the answer nor a token's kind, and the target's state carries both, while the draft's adds
nothing that q does not. "lenience-target" reads the target alone (its state and TARGET_FEATURES, which
need no q): it serves every drafter, copied drafts (a point mass, no draft distribution) included.

The dial (Verification.shift, "diversed:HEAD@+k") moves a head's logit: w = sigmoid(logit(w) + k) for a mixture
head and L = max_lenience sigmoid(logit(L / max_lenience) - k) for a lenience head, so +k is stricter for
both (more weight on the target, less lenience) and L stays below max_lenience at every k.

Heads always run in float32: in bfloat16 the small updates round away.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from diversed.head.names import ARCHITECTURES, CONFIG_FILE, KINDS, TARGET_ONLY, WEIGHTS_FILE, head_folder
from diversed.verify import entropy, total_variation

# A lenience head's numbers per drafted token x: p(x), max p and H(p) in nats, then q(x) and TV(q, p). The
# target-only kind reads the first TARGET_FEATURES.
FEATURES = ("p(x)", "max p", "H(p)", "q(x)", "TV(q, p)")
TARGET_FEATURES = 3


@dataclass
class HeadConfig:
    """Everything needed to rebuild a head and to refuse using it with the wrong models. kind: what it sets
    (diversed.head.names.KINDS; a head saved before lenience heads is a mixture head); max_lenience and
    initial_lenience: a lenience head's bound and its output before training."""

    draft_hidden: int
    target_hidden: int
    architecture: str = "linear"
    mlp_hidden: int = 256
    initial_weight: float = 0.5
    draft_model: str = ""
    target_model: str = ""
    training: dict = field(default_factory=dict)  # task, lambda, temperature, draft length, data, date, ...
    kind: str = "mixture"
    max_lenience: float = 0.99
    initial_lenience: float = 0.5

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"head architecture must be one of {ARCHITECTURES}, got {self.architecture!r}")
        if self.kind not in KINDS:
            raise ValueError(f"head kind must be one of {KINDS}, got {self.kind!r}")
        if not 0.0 < self.initial_weight < 1.0:
            raise ValueError(f"initial weight must be in (0, 1), got {self.initial_weight}")
        if not 0.0 < self.max_lenience < 1.0:
            raise ValueError(f"max lenience must be in (0, 1), got {self.max_lenience}")
        if not 0.0 < self.initial_lenience < self.max_lenience:
            raise ValueError(f"initial lenience must be in (0, max lenience = {self.max_lenience}), got "
                             f"{self.initial_lenience}")

    @property
    def features(self) -> int:
        """How many of FEATURES the head reads (none: a mixture head)."""
        return {"mixture": 0, TARGET_ONLY: TARGET_FEATURES}.get(self.kind, len(FEATURES))


class EnsembleHead(nn.Module):
    """A head's value per token, top * sigmoid(f(inputs)), f linear or a small MLP; top is 1 for w and
    max_lenience for L. It starts at the initial value everywhere (the last layer's weights are zero, its
    bias the logit of the initial value's share of top). Built for its kind by `build` (or `load`); this class
    is the mixture head, w from [h_draft ; h_target]."""

    rule = "dynamic"  # the verification rule its values are for: the mixture weight of each drafted token

    def __init__(self, config: HeadConfig) -> None:
        super().__init__()
        self.config = config
        width = config.target_hidden + (config.features or config.draft_hidden)
        if config.architecture == "linear":
            self.net = nn.Linear(width, 1)
            last = self.net
        else:
            last = nn.Linear(config.mlp_hidden, 1)
            self.net = nn.Sequential(nn.Linear(width, config.mlp_hidden), nn.GELU(), last)
        share = config.initial_weight if config.kind == "mixture" else config.initial_lenience / config.max_lenience
        nn.init.zeros_(last.weight)
        nn.init.constant_(last.bias, math.log(share / (1.0 - share)))
        self.float()

    @property
    def top(self) -> float:
        """The supremum of the head's value: 1 for w, max_lenience for L."""
        return 1.0 if self.config.kind == "mixture" else self.config.max_lenience

    def forward(self, h_draft: Tensor | None, h_target: Tensor, features: Tensor | None = None) -> Tensor:
        """The head's value [...] in (0, top): w from h_draft [..., d_draft] and h_target [..., d_target] for a
        mixture head; L from h_target and features [..., len(FEATURES)] (token_features) for a lenience head."""
        return self.top * torch.sigmoid(self.logit(h_draft, h_target, features))

    def logit(self, h_draft: Tensor | None, h_target: Tensor, features: Tensor | None = None) -> Tensor:
        """f(inputs) [...], the logit of the value's share of top."""
        config = self.config
        draft_size = h_draft.shape[-1] if h_draft is not None else None
        if h_target.shape[-1] != config.target_hidden or (not config.features and draft_size != config.draft_hidden):
            raise ValueError(f"head expects hidden sizes ({config.draft_hidden}, {config.target_hidden}), "
                             f"got ({draft_size}, {h_target.shape[-1]})")
        if config.features and (features is None or features.shape[-1] < config.features):
            raise ValueError(f"a {config.kind!r} head reads {config.features} features per token (FEATURES), got "
                             f"{None if features is None else features.shape[-1]}")
        # Decision (not in the paper): each hidden state is layer-normalised first. The models' final norms
        # leave per-channel scales in the tens, and normalising keeps one learning rate right for any pair.
        side = features[..., :config.features].float() if config.features else _normalize(h_draft)
        return self.net(torch.cat([side, _normalize(h_target)], dim=-1)).squeeze(-1)

    def save(self, directory: str | Path) -> Path:
        """Write head.safetensors and head.json into directory (created if needed), each through a
        temporary file and a rename, so a killed write never leaves a half file under the real name."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        weights, config = directory / (WEIGHTS_FILE + ".tmp"), directory / (CONFIG_FILE + ".tmp")
        save_file({k: v.detach().cpu().contiguous() for k, v in self.state_dict().items()}, weights)
        config.write_text(json.dumps(asdict(self.config), indent=2) + "\n")
        weights.replace(directory / WEIGHTS_FILE)
        config.replace(directory / CONFIG_FILE)
        return directory

    @classmethod
    def load(cls, directory: str | Path | None = None, *, draft_hidden: int | None = None,
             target_hidden: int | None = None, draft_model: str | None = None,
             target_model: str | None = None) -> EnsembleHead:
        """Load a saved head of the kind its config records (a folder, a shipped head's name or None for the
        default: head_folder), refusing one trained for other hidden sizes or other models (a target-only head
        for another target only: it reads nothing of the draft model)."""
        directory = head_folder(directory)
        config_path, weights_path = directory / CONFIG_FILE, directory / WEIGHTS_FILE
        try:
            config = HeadConfig(**json.loads(config_path.read_text()))
        except (json.JSONDecodeError, TypeError) as err:
            raise ValueError(f"corrupt head config {config_path}: {err}") from None
        checks = [("target hidden size", target_hidden, config.target_hidden),
                  ("target model", target_model, config.target_model)]
        if config.kind != TARGET_ONLY:
            checks += [("draft hidden size", draft_hidden, config.draft_hidden),
                       ("draft model", draft_model, config.draft_model)]
        for what, expected, actual in checks:
            if expected is not None and expected != actual:
                raise ValueError(f"head in {directory} was trained for {what} {actual!r}, not {expected!r}")
        head = build(config)
        try:
            head.load_state_dict(load_file(weights_path))
        except Exception as err:  # safetensors raises its own error types for truncated or foreign files
            raise ValueError(f"corrupt head weights {weights_path}: {err}") from None
        return head


class LenienceHead(EnsembleHead):
    """A head of kind "lenience" or "lenience-target": L per drafted token for rule "lossy" (the module
    docstring says what it reads and why). Decoding calls `lenience` (diversed.decoding.policy.LenienceHead)."""

    rule = "lossy"

    def lenience(self, drafts: Tensor, q: Tensor | None, p: Tensor, h_target: Tensor, shift: float | None = None
                 ) -> Tensor:
        """L [B, N] in [0, max_lenience] for the drafts [B, N], from q [B, N, V] (None for copied drafts;
        the target-only kind never reads it), p [B, N, V] and the target's hidden states [B, N, d_target];
        shift: the dial, +k stricter (the module docstring)."""
        z = self.logit(None, h_target, token_features(drafts, q, p))
        return self.top * torch.sigmoid(z - (shift or 0.0))


def build(config: HeadConfig) -> EnsembleHead:
    """A new head of the kind its config names."""
    return (EnsembleHead if config.kind == "mixture" else LenienceHead)(config)


def token_features(drafts: Tensor, q: Tensor | None, p: Tensor) -> Tensor:
    """FEATURES [..., 5] (float32) of each drafted token x, drafts [...], from q and p [..., V]; q None for
    copied drafts, point masses: q(x) = 1 and TV(q, p) = 1 - p(x)."""
    p = p.float()
    x = drafts.unsqueeze(-1).to(p.device)
    p_x = p.gather(-1, x).squeeze(-1)
    if q is None:
        q_x, tv = torch.ones_like(p_x), 1.0 - p_x
    else:
        q = q.float()
        q_x, tv = q.gather(-1, x).squeeze(-1), total_variation(q, p)
    return torch.stack([p_x, p.amax(-1), entropy(p), q_x, tv], dim=-1)


def _normalize(h: Tensor) -> Tensor:
    return torch.nn.functional.layer_norm(h.float(), h.shape[-1:])

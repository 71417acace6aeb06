"""The knobs of head training, checked before anything loads (imports no torch)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from diversed.head.names import CONFIG_FILE, KINDS, head_folder
from diversed.request import DRAFTER_CLASSES

# Whose drafts a head's rollouts verify: one drafter each (not "auto", whose choice follows the clock).
TRAINING_DRAFTERS = tuple(DRAFTER_CLASSES)


@dataclass
class TrainConfig:
    """The knobs of head training.

    kind: what the head sets per drafted token (diversed.head.names.KINDS): "mixture" (w, rule "dynamic"),
    "lenience" (L of rule "lossy", from the target and the draft distribution) or "lenience-target" (L from
    the target alone); max_lenience and initial_lenience: a lenience head's bound and its starting L
    (initial_weight is a mixture head's starting w).
    lam: the speed/quality dial, the weight of the acceptance term A'(y) = mean_t (1 - rejection_t / mean TV),
    the expected acceptance along a completion measured in units of the step's mean TV(q, p), exact's
    rejection rate (rejection_t = w_t TV_t for a mixture head, 1 - a_t(L_t) for a lenience head): 1 where
    nothing is rejected, about 0 at exact, for any pair (unnormalised, lambda's useful range moved with how
    much the two models disagree; benchmarks/RESULTS.md has the runs that set the default). The log's
    pg_grad_norm and acceptance_grad_norm show which term pulls harder.
    ppo_epochs, minibatches, clip: each step's rollouts are used for ppo_epochs passes of `minibatches`
    updates each (random minibatches of completions); a token's importance ratio is clipped to [1 - clip,
    1 + clip] (diversed.head.ppo).
    """

    lam: float = 0.3
    temperature: float = 1.0
    draft_length: int = 5
    max_new_tokens: int = 128
    lr: float = 5e-4
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    epochs: int = 1
    prompts_per_step: int = 2
    samples_per_prompt: int = 4
    ppo_epochs: int = 4
    minibatches: int = 1
    clip: float = 0.2
    limit: int | None = None  # training examples used (None: the whole train split)
    checkpoint_every: int = 5
    architecture: str = "linear"
    initial_weight: float = 0.5
    kind: str = "mixture"
    max_lenience: float = 0.99
    initial_lenience: float = 0.5
    init_head: str | None = None  # warm start: a head or checkpoint folder (same pair, architecture) to begin from
    # Update only on the prompts whose samples' rewards differ (both terms; a step without any is skipped):
    # elsewhere the reward term is 0 and the acceptance term alone would pull w down unopposed.
    informative_only: bool = False
    seed: int = 0
    # Whose drafts the rollouts verify: the draft model's, or a copying drafter's ("lookup", "suffix",
    # "prediction": each example's input text as its predicted output), point masses that only a lenience head
    # can verify (a mixture head reads the draft model's hidden states).
    drafter: str = "model"

    def __post_init__(self) -> None:
        for name in ("lam", "temperature", "lr", "weight_decay", "grad_clip", "clip", "initial_weight",
                     "max_lenience", "initial_lenience"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{'lambda' if name == 'lam' else name} must be a finite number, got "
                                 f"{getattr(self, name)}")
        if not self.lam >= 0:
            raise ValueError(f"lambda must be >= 0, got {self.lam}")
        if not 0 < self.initial_weight < 1:
            raise ValueError(f"initial weight must be in (0, 1), got {self.initial_weight}")
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        if not 0 < self.initial_lenience < self.max_lenience < 1:
            raise ValueError(f"initial and max lenience must be 0 < initial < max < 1, got {self.initial_lenience} "
                             f"and {self.max_lenience}")
        if not 0 <= self.seed < 2**32:  # each batch's seed is seed * 1_000_003 + its index: well under 2**63
            raise ValueError(f"seed must be an integer in [0, 2**32), got {self.seed}")
        for name in ("draft_length", "max_new_tokens", "epochs", "prompts_per_step", "checkpoint_every", "ppo_epochs",
                     "minibatches"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"limit must be >= 1 (or None for all examples), got {self.limit}")
        if not self.lr > 0 or not self.grad_clip > 0 or not self.clip > 0:
            raise ValueError(f"lr, grad_clip and clip must be > 0, got {self.lr}, {self.grad_clip} and {self.clip}")
        if self.samples_per_prompt < 2:
            raise ValueError("samples_per_prompt must be >= 2: the baseline is the other samples' mean reward")
        if self.minibatches > self.prompts_per_step * self.samples_per_prompt:
            raise ValueError(f"minibatches ({self.minibatches}) must be at most the completions per step "
                             f"({self.prompts_per_step * self.samples_per_prompt})")
        if self.temperature <= 0:
            raise ValueError("training samples from the ensemble: temperature must be > 0")
        if self.drafter not in TRAINING_DRAFTERS:
            raise ValueError(f"drafter must be one of {TRAINING_DRAFTERS}, got {self.drafter!r}")
        if self.drafter != "model" and self.kind == "mixture":
            raise ValueError(f"a mixture head reads the draft model's hidden states, and drafter {self.drafter!r} "
                             "copies text: train kind 'lenience-target' (or 'lenience') on copied drafts")
        if self.init_head is not None:
            start = json.loads((head_folder(self.init_head) / CONFIG_FILE).read_text())
            for name, default in (("architecture", None), ("kind", "mixture")):  # heads before kinds: mixture
                if (theirs := start.get(name, default)) != getattr(self, name):
                    raise ValueError(f"the head in {self.init_head} is {theirs!r}, this run trains "
                                     f"{getattr(self, name)!r}: pass --{name} {theirs}")

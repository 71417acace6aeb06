"""The DIVERSED weight head: from both models' last hidden states to a weight w on the target, per token.

Input at a drafted position: [h_draft ; h_target], the last-layer hidden states (after the final norm) that
produced q_i and p_i. Output: w_i in (0, 1), the target's share of the ensemble nu_i = w_i p_i + (1-w_i) q_i.
The paper's head is Linear(d_draft + d_target, 2) and a softmax over (draft, target); a softmax over two
logits is a sigmoid of their difference, so one output logit is the same family without the redundant
parameters. It always runs in float32: in bfloat16 the small updates round away.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from diversed.head.names import ARCHITECTURES, CONFIG_FILE, WEIGHTS_FILE, head_folder


@dataclass
class HeadConfig:
    """Everything needed to rebuild a head and to refuse using it with the wrong models."""

    draft_hidden: int
    target_hidden: int
    architecture: str = "linear"
    mlp_hidden: int = 256
    initial_weight: float = 0.5
    draft_model: str = ""
    target_model: str = ""
    training: dict = field(default_factory=dict)  # task, lambda, temperature, draft length, data, date, ...

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"head architecture must be one of {ARCHITECTURES}, got {self.architecture!r}")
        if not 0.0 < self.initial_weight < 1.0:
            raise ValueError(f"initial weight must be in (0, 1), got {self.initial_weight}")


class EnsembleHead(nn.Module):
    """w = sigmoid(f([h_draft ; h_target])), f linear or a small MLP; starts at w = initial_weight
    everywhere (the last layer's weights are zero, its bias the logit of the initial weight)."""

    def __init__(self, config: HeadConfig) -> None:
        super().__init__()
        self.config = config
        width = config.draft_hidden + config.target_hidden
        if config.architecture == "linear":
            self.net = nn.Linear(width, 1)
            last = self.net
        else:
            last = nn.Linear(config.mlp_hidden, 1)
            self.net = nn.Sequential(nn.Linear(width, config.mlp_hidden), nn.GELU(), last)
        nn.init.zeros_(last.weight)
        nn.init.constant_(last.bias, math.log(config.initial_weight / (1.0 - config.initial_weight)))
        self.float()

    def forward(self, h_draft: Tensor, h_target: Tensor) -> Tensor:
        """Weights w [...] in (0, 1) from h_draft [..., d_draft] and h_target [..., d_target]."""
        if h_draft.shape[-1] != self.config.draft_hidden or h_target.shape[-1] != self.config.target_hidden:
            raise ValueError(f"head expects hidden sizes ({self.config.draft_hidden}, {self.config.target_hidden}), "
                             f"got ({h_draft.shape[-1]}, {h_target.shape[-1]})")
        # Decision (not in the paper): each half is layer-normalised first. The models' final norms leave
        # per-channel scales in the tens, and normalising keeps one learning rate right for any pair.
        x = torch.cat([_normalize(h_draft), _normalize(h_target)], dim=-1)
        return torch.sigmoid(self.net(x).squeeze(-1))

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
        """Load a saved head (a folder, a shipped head's name or None for the default: head_folder), refusing
        one trained for other hidden sizes or other models."""
        directory = head_folder(directory)
        config_path, weights_path = directory / CONFIG_FILE, directory / WEIGHTS_FILE
        try:
            config = HeadConfig(**json.loads(config_path.read_text()))
        except (json.JSONDecodeError, TypeError) as err:
            raise ValueError(f"corrupt head config {config_path}: {err}") from None
        for what, expected, actual in (("draft hidden size", draft_hidden, config.draft_hidden),
                                       ("target hidden size", target_hidden, config.target_hidden),
                                       ("draft model", draft_model, config.draft_model),
                                       ("target model", target_model, config.target_model)):
            if expected is not None and expected != actual:
                raise ValueError(f"head in {directory} was trained for {what} {actual!r}, not {expected!r}")
        head = cls(config)
        try:
            head.load_state_dict(load_file(weights_path))
        except Exception as err:  # safetensors raises its own error types for truncated or foreign files
            raise ValueError(f"corrupt head weights {weights_path}: {err}") from None
        return head


def _normalize(h: Tensor) -> Tensor:
    return torch.nn.functional.layer_norm(h.float(), h.shape[-1:])

"""One training step's rollouts, kept on disk so the head learns from them without running the models again.

A step's rollouts are its `prompts_per_step x samples_per_prompt` completions, sampled together by
speculative decoding with the head of that time, which keeps what the verifier saw at each token
(diversed.head.train.Trace). They are kept flat over the generated tokens (no
padding): for each token what the loss needs (the head's inputs, the token, p_t(y_t), q_t(y_t),
TV(q_t, p_t), the drafted token's numbers a lenience head reads and whether it was kept, whether it was a
bonus token, the sampling head's w_t or L_t, the completion it belongs to) and for each completion its
reward and advantage. Bonus tokens had no draft and no w: the loss and the statistics use the other
("scored") tokens only.

On disk, in a run's rollouts/ folder: step-000012.safetensors (the tensors; the head's inputs in float16,
which halves the file and is where the stored w_t was computed) and step-000012.json (what a person reads:
the examples, the completions with their rewards, decoding statistics); about 5 kB a token for the default
pair (896 + 1536 float16 inputs), a few MB a step. Nothing is pickled. The safetensors file is written
last, through a temporary name: a step's rollouts count as stored once it exists, so a run killed while
storing them redoes that step's rollouts and no other.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

ROLLOUTS = "rollouts"  # the folder of stored rollouts inside a training run's output
_PER_TOKEN = ("h_draft", "h_target", "token", "p_y", "q_y", "tv", "features", "kept", "bonus", "old_w", "sequence")
_PER_SEQUENCE = ("reward", "advantage")


@dataclass
class Rollouts:
    """A batch of sampled completions, flat over their N generated tokens; S completions."""

    h_draft: Tensor  # [N, d_draft] float16: the draft's last hidden state that predicted the token
    h_target: Tensor  # [N, d_target] float16: the target's
    token: Tensor  # [N] int64: the token y_t
    p_y: Tensor  # [N] float32: p_t(y_t), the target's probability of it
    q_y: Tensor  # [N] float32: q_t(y_t), the draft's
    tv: Tensor  # [N] float32: TV(q_t, p_t)
    # [N, 5] float32: diversed.head.model.FEATURES of the token drafted at t (y_t where it was kept; the
    # rejected draft where y_t is the correction); zeros at bonus tokens
    features: Tensor
    kept: Tensor  # [N] bool: the draft at t was kept (y_t is it), not rejected (y_t is the correction)
    bonus: Tensor  # [N] bool: drawn from p (after a fully kept round, or by the target alone), not from nu_t
    old_w: Tensor  # [N] float32: w_t (a lenience head: L_t) of the head that sampled the batch, on these inputs
    sequence: Tensor  # [N] int64: the completion the token belongs to, 0..S-1, in order
    reward: Tensor  # [S] float32: the task's reward
    advantage: Tensor  # [S] float32: the reward minus the mean reward of the other samples of its prompt
    mean_tv: float  # TV averaged over the step's scored tokens: the unit of the acceptance term
    info: dict = field(default_factory=dict)  # examples, completions, decoding statistics, seconds (JSON)

    def select(self, rows: Tensor) -> Rollouts:
        """The completions `rows` (indices into 0..S-1) and their tokens, renumbered 0..len(rows)-1 in their
        original order."""
        rows = rows.to(self.sequence.device).sort().values
        keep = torch.isin(self.sequence, rows)
        renumber = torch.full_like(self.reward, -1, dtype=torch.long)
        renumber[rows] = torch.arange(len(rows), device=rows.device)
        tokens = {name: getattr(self, name)[keep] for name in _PER_TOKEN}
        tokens["sequence"] = renumber[tokens["sequence"]]
        return replace(self, **tokens, reward=self.reward[rows], advantage=self.advantage[rows])

    def per_sequence_mean(self, values: Tensor) -> Tensor:
        """The mean over completions of each completion's mean of `values` [N] over its scored tokens."""
        scored = ~self.bonus
        lengths = torch.bincount(self.sequence[scored], minlength=len(self.reward)).clamp_min(1)
        return (values[scored] / lengths[self.sequence[scored]]).sum() / len(self.reward)

    def summary(self, rejection: Tensor) -> dict:
        """What the log reports about the rollouts, given each token's rejection probability with the sampling
        head (diversed.head.ppo.rejection): mean reward, the acceptance proxy A (1 - rejection, averaged), the
        measured acceptance rate, mean w (for a lenience head, L: "w" in the log is the head's value) and its
        spread over the scored tokens (a head that tells
        tokens apart from a static weight in disguise), mean w at the completions' first tokens, the mean w
        weighted by TV (the w where the models disagree, which alone sets how many drafts are rejected: most
        tokens have TV near 0, where w changes nothing), the mean TV, the tokens and the seconds they took (of
        which the teacher-forced rescoring, in runs from before rollouts were traced)."""
        w, tv = self.old_w[~self.bonus], self.tv[~self.bonus]
        first = torch.ones_like(self.sequence, dtype=torch.bool)
        first[1:] = self.sequence[1:] != self.sequence[:-1]
        return {"reward": self.reward.mean().item(),
                "acceptance": self.per_sequence_mean(1 - rejection).item(),
                "acceptance_rate": self.info["acceptance_rate"], "mean_w": w.mean().item(),
                "w_std": w.std().item() if len(w) > 1 else 0.0, "first_w": self.old_w[first].mean().item(),
                "disagreement_w": ((w * tv).sum() / tv.sum()).item() if tv.sum() > 0 else float("nan"),
                "mean_tv": self.mean_tv,
                "new_tokens": self.info["new_tokens"], "rollout_seconds": self.info["seconds"],
                **({"scoring_seconds": self.info["scoring_seconds"]} if "scoring_seconds" in self.info else {})}

    def save(self, folder: str | Path, step: int) -> None:
        """Write step-{step}.json, then step-{step}.safetensors, each through a temporary file and a rename."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        stem = _stem(step)
        info = folder / f"{stem}.json.tmp"
        info.write_text(json.dumps({**self.info, "mean_tv": self.mean_tv}, indent=1) + "\n")
        info.replace(folder / f"{stem}.json")
        tensors = folder / f"{stem}.safetensors.tmp"
        save_file({name: getattr(self, name).detach().cpu().contiguous() for name in _PER_TOKEN + _PER_SEQUENCE},
                  tensors)
        tensors.replace(folder / f"{stem}.safetensors")

    @classmethod
    def load(cls, folder: str | Path, step: int, device: torch.device | str = "cpu") -> Rollouts | None:
        """The rollouts stored for `step`, on `device`; None if there are none."""
        folder, stem = Path(folder), _stem(step)
        if not (folder / f"{stem}.safetensors").exists():
            return None
        tensors = load_file(folder / f"{stem}.safetensors", device=str(device))
        info = json.loads((folder / f"{stem}.json").read_text())
        return cls(**tensors, mean_tv=info.pop("mean_tv"), info=info)


def leave_one_out(rewards: Tensor, samples_per_prompt: int) -> Tensor:
    """Each reward minus the mean of the other samples of its prompt (samples of a prompt are adjacent).
    The baseline does not depend on the sample's own reward, so the gradient stays unbiased."""
    grouped = rewards.view(-1, samples_per_prompt)
    others = (grouped.sum(-1, keepdim=True) - grouped) / (samples_per_prompt - 1)
    return (grouped - others).view(-1)


def informative_rows(rewards: Tensor, samples_per_prompt: int) -> Tensor:
    """The completions of the prompts whose samples' rewards differ: the only ones the reward term learns
    from (where all samples of a prompt got the same reward, every advantage is 0)."""
    grouped = rewards.view(-1, samples_per_prompt)
    differ = (grouped != grouped[:, :1]).any(-1)
    return differ.repeat_interleave(samples_per_prompt).nonzero().flatten()


def _stem(step: int) -> str:
    return f"step-{step:06d}"

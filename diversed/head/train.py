"""Training the weight head with sequence-level REINFORCE plus an acceptance reward (ALGORITHM.md section 4).

One step:
  1. rollouts: for each of `prompts_per_step` prompts, `samples_per_prompt` completions sampled from the
     ensemble nu_t = w_t p_t + (1 - w_t) q_t by speculative decoding with the "dynamic" rule and the current
     head (every emitted token but the bonus tokens is distributed exactly as nu_t);
  2. rewards R(y) from the task;
  3. one teacher-forced pass of both (frozen) models over prompt + completion: hidden states, p_t(y_t),
     q_t(y_t) and TV(q_t, p_t) at every generated position;
  4. loss = mean over sequences of  -(R - b) * sum_t log nu_t(y_t)  -  lambda * A(y),
     A(y) = mean_t (1 - w_t TV(q_t, p_t)) the expected acceptance, b the mean reward of the other samples of
     the same prompt. The log-probability sums over non-bonus tokens only: bonus tokens come from p, which
     does not depend on the head. (The head also changes which positions become bonus tokens; like the
     paper, the estimator ignores that dependence, a small bias where bonus tokens are rare.)
Only the head trains. Checkpoints (safetensors + JSON) every few steps make a killed run resumable.
"""

from __future__ import annotations

import json
import random
import shutil
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Protocol

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor
from tqdm import tqdm

from diversed.decoding.engine import decode
from diversed.decoding.method import Method
from diversed.decoding.sampling import Sampling
from diversed.decoding.schedule import DraftLength
from diversed.generation import cut_at_stop, encode_prompt, stop_checker
from diversed.head.model import CONFIG_FILE, EnsembleHead, HeadConfig
from diversed.models.loading import Pair
from diversed.verify import total_variation


class Task(Protocol):
    """What training needs of a task (diversed.tasks): examples with a .prompt, a reward, stop strings."""

    name: str
    stop: Sequence[str]

    def examples(self, split: str, limit: int | None = None) -> list: ...

    def reward(self, example, completion: str) -> float: ...


STATE_FILE, OPTIMIZER_FILE, LOG_FILE = "train_state.json", "optimizer.safetensors", "log.jsonl"
CHECKPOINT = "checkpoint"  # the folder of the last checkpoint inside a training run's output


@dataclass
class TrainConfig:
    """The knobs of head training. `lam` is the speed/quality dial: larger raises acceptance."""

    lam: float = 1.0
    temperature: float = 1.0
    draft_len: int = 5
    max_new_tokens: int = 128
    lr: float = 5e-4
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    epochs: int = 1
    prompts_per_step: int = 2
    samples_per_prompt: int = 4
    limit: int | None = None  # training examples used (None: the whole train split)
    checkpoint_every: int = 5
    architecture: str = "linear"
    initial_weight: float = 0.5
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.lam >= 0:
            raise ValueError(f"lambda must be >= 0, got {self.lam}")
        for name in ("draft_len", "max_new_tokens", "epochs", "prompts_per_step", "checkpoint_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"limit must be >= 1 (or None for all examples), got {self.limit}")
        if not self.lr > 0 or not self.grad_clip > 0:
            raise ValueError(f"lr and grad_clip must be > 0, got {self.lr} and {self.grad_clip}")
        if self.samples_per_prompt < 2:
            raise ValueError("samples_per_prompt must be >= 2: the baseline is the other samples' mean reward")
        if self.temperature <= 0:
            raise ValueError("training samples from the ensemble: temperature must be > 0")


def train_head(pair: Pair, task: Task, config: TrainConfig, out_dir: str | Path, *, resume: bool = False,
               progress: bool = True) -> EnsembleHead:
    """Train a head for the pair on the task's training split; write checkpoints, a JSONL log (one line per
    step: reward, acceptance proxy A, measured acceptance rate, mean w and its spread over tokens, loss) and
    the final head to out_dir.

    With resume=True, continue from the last checkpoint in out_dir (the same config is required)."""
    out_dir = Path(out_dir)
    examples = task.examples("train", limit=config.limit)
    if not examples:
        raise ValueError(f"task {task.name!r} has no training examples")
    head_config = HeadConfig(
        pair.draft.hidden_size, pair.target.hidden_size, config.architecture,
        initial_weight=config.initial_weight, draft_model=pair.draft_name, target_model=pair.target_name,
        training={**asdict(config), "task": task.name, "examples": len(examples)})
    head = EnsembleHead(head_config).to(pair.target.device)
    optimizer = torch.optim.AdamW(head.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    steps_per_epoch = -(-len(examples) // config.prompts_per_step)
    total_steps = steps_per_epoch * config.epochs
    step = _resume(out_dir, head, optimizer, config) if resume else _fresh(out_dir)

    sampling = Sampling(config.temperature)
    ids = [encode_prompt(pair.tokenizer, e.prompt) for e in examples]
    bar = tqdm(total=total_steps, initial=step, desc="training head", disable=not progress, dynamic_ncols=True)
    while step < total_steps:
        epoch, index = divmod(step, steps_per_epoch)
        order = list(range(len(examples)))
        random.Random(config.seed + epoch).shuffle(order)  # a function of (seed, epoch): resumable
        chosen = order[index * config.prompts_per_step:(index + 1) * config.prompts_per_step]
        started = time.perf_counter()
        record = _step(pair, head, optimizer, [ids[i] for i in chosen], [examples[i] for i in chosen], task,
                       config, sampling, seed=config.seed * 1_000_003 + step)
        step += 1
        record.update(step=step, epoch=epoch, seconds=time.perf_counter() - started)
        with open(out_dir / LOG_FILE, "a") as log:
            log.write(json.dumps(record) + "\n")
        bar.update()
        bar.set_postfix(reward=f"{record['reward']:.2f}", accept=f"{record['acceptance']:.2f}",
                        w=f"{record['mean_w']:.2f}")
        if step % config.checkpoint_every == 0 or step == total_steps:
            _checkpoint(out_dir, head, optimizer, step, config)
    bar.close()
    head.config.training["date"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    head.save(out_dir)
    return head


def _step(pair: Pair, head: EnsembleHead, optimizer: torch.optim.Optimizer, prompt_ids: list[list[int]],
          examples: list, task: Task, config: TrainConfig, sampling: Sampling, seed: int) -> dict:
    k = config.samples_per_prompt
    batch = [p for p in prompt_ids for _ in range(k)]
    with torch.no_grad():
        rollout = decode(pair.target, batch, draft=pair.draft, method=Method("dynamic"), sampling=sampling,
                         draft_length=DraftLength(config.draft_len), max_new_tokens=config.max_new_tokens,
                         eos_token_ids=pair.eos_token_ids, weight_fn=head, seed=seed,
                         stop=stop_checker(pair.tokenizer, task.stop))
    texts = [cut_at_stop(pair.tokenizer.decode(t, skip_special_tokens=True), task.stop) for t in rollout.tokens]
    rewards = torch.tensor([task.reward(examples[i // k], text) for i, text in enumerate(texts)],
                           device=pair.target.device)
    grouped = rewards.view(-1, k)
    baseline = ((grouped.sum(-1, keepdim=True) - grouped) / (k - 1)).view(-1)  # leave-one-out mean

    h_draft, h_target, p_y, q_y, tv, mask, scored = score_completions(pair, batch, rollout.tokens,
                                                                      rollout.bonus, sampling)
    w = head(h_draft, h_target)
    # where() before the log: a masked-out log(0) would still send NaN through the backward pass.
    log_nu = torch.log(torch.where(scored, w * p_y + (1 - w) * q_y, 1.0)).sum(-1)
    acceptance = ((1 - w * tv) * mask).sum(-1) / mask.sum(-1).clamp_min(1)
    loss = (-(rewards - baseline) * log_nu - config.lam * acceptance).mean()
    optimizer.zero_grad()
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(head.parameters(), config.grad_clip)
    optimizer.step()
    summary = rollout.summary()
    # The spread of w over tokens tells a head that tells tokens apart from a static weight in disguise.
    w_tokens = w.detach()[mask]
    return {"loss": loss.item(), "reward": rewards.mean().item(), "acceptance": acceptance.mean().item(),
            "acceptance_rate": summary["acceptance_rate"], "mean_w": w_tokens.mean().item(),
            "w_std": w_tokens.std().item() if w_tokens.numel() > 1 else 0.0,
            "grad_norm": grad_norm.item(), "new_tokens": summary["new_tokens"]}


@torch.no_grad()
def score_completions(pair: Pair, prompts: list[list[int]], completions: list[list[int]],
                      bonus: list[list[bool]], sampling: Sampling
                      ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Teacher-forced pass of both models over prompt + completion.

    Returns, per sequence and generated position t ([B, T], padded): the draft's and target's last hidden
    states that predict y_t (float32, [B, T, d]), p_t(y_t), q_t(y_t), TV(q_t, p_t), the mask of real
    positions, and the mask of positions whose token came from the ensemble (not a bonus token); all on
    the target's device.
    """
    length = max(map(len, completions))
    # Completions are padded at their end (with their own last token): causal attention keeps the real
    # positions exact, and every row then has `length` positions to score.
    padded = [c + [c[-1] if c else 0] * (length - len(c)) for c in completions]
    fed = [p + c[:-1] for p, c in zip(prompts, padded, strict=True)]
    mask = torch.tensor([[t < len(c) for t in range(length)] for c in completions], dtype=torch.bool)
    scored = torch.tensor([[t < len(c) and not b[t] for t in range(length)] for c, b in zip(completions, bonus,
                                                                                              strict=True)])
    device = pair.target.device
    out = []
    for model in (pair.draft, pair.target):
        hidden, logits = model.rows(len(prompts)).feed(fed, length, hidden=True)
        out.append((hidden.float().to(device), sampling.probs(logits).to(device)))
    (h_draft, q), (h_target, p) = out
    targets = torch.tensor(padded, device=device).unsqueeze(-1)
    p_y, q_y = p.gather(-1, targets).squeeze(-1), q.gather(-1, targets).squeeze(-1)
    return h_draft, h_target, p_y, q_y, total_variation(q, p), mask.to(device), (scored & mask).to(device)


def _fresh(out_dir: Path) -> int:
    if any((out_dir / name).exists() for name in (CHECKPOINT, CHECKPOINT + ".old", LOG_FILE, CONFIG_FILE)):
        raise ValueError(f"{out_dir} already holds a training run: pass resume=True (--resume) or another --out")
    out_dir.mkdir(parents=True, exist_ok=True)
    return 0


def _checkpoint(out_dir: Path, head: EnsembleHead, optimizer: torch.optim.Optimizer, step: int,
                config: TrainConfig) -> None:
    """Head weights, AdamW moments and the step, written together into out_dir/checkpoint.

    They go to a new folder first, which then replaces the old one: a run killed at any moment leaves one
    complete checkpoint (checkpoint, or checkpoint.old during the swap), never a mix of two steps."""
    new, current, old = out_dir / (CHECKPOINT + ".tmp"), out_dir / CHECKPOINT, out_dir / (CHECKPOINT + ".old")
    shutil.rmtree(new, ignore_errors=True)
    head.save(new)
    tensors, scalars = {}, {}
    for i, state in optimizer.state_dict()["state"].items():
        for name, value in state.items():
            if torch.is_tensor(value) and value.dim() > 0:
                tensors[f"{i}.{name}"] = value.detach().cpu().contiguous()
            else:
                scalars[f"{i}.{name}"] = float(value)
    save_file(tensors, new / OPTIMIZER_FILE)
    state = {"step": step, "config": asdict(config), "optimizer_scalars": scalars}
    (new / STATE_FILE).write_text(json.dumps(state, indent=1))
    if current.exists():
        shutil.rmtree(old, ignore_errors=True)
        current.rename(old)
    new.rename(current)
    shutil.rmtree(old, ignore_errors=True)


def _resume(out_dir: Path, head: EnsembleHead, optimizer: torch.optim.Optimizer, config: TrainConfig) -> int:
    folder = next((out_dir / n for n in (CHECKPOINT, CHECKPOINT + ".old") if (out_dir / n / STATE_FILE).exists()),
                  None)
    if folder is None:
        raise FileNotFoundError(f"nothing to resume in {out_dir}: no checkpoint")
    state = json.loads((folder / STATE_FILE).read_text())
    if state["config"] != asdict(config):
        changed = sorted(k for k in state["config"] if state["config"][k] != asdict(config).get(k))
        raise ValueError(f"cannot resume {out_dir} with a different config (changed: {', '.join(changed)})")
    head.load_state_dict(EnsembleHead.load(folder).state_dict())
    per_param: dict[int, dict] = {}
    for key, value in load_file(folder / OPTIMIZER_FILE).items():
        i, name = key.split(".", 1)
        per_param.setdefault(int(i), {})[name] = value
    for key, value in state["optimizer_scalars"].items():
        i, name = key.split(".", 1)
        per_param.setdefault(int(i), {})[name] = torch.tensor(value)
    saved = optimizer.state_dict()
    saved["state"] = per_param
    optimizer.load_state_dict(saved)
    # Drop log lines written after the checkpoint, so the log matches the resumed run exactly.
    log = out_dir / LOG_FILE
    if log.exists():
        lines = [ln for ln in log.read_text().splitlines() if ln.strip() and json.loads(ln)["step"] <= state["step"]]
        log.write_text("".join(ln + "\n" for ln in lines))
    return state["step"]

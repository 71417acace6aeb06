"""Training a head: PPO-style updates on stored rollouts, plus an acceptance reward (docs/algorithm.md
section 4).

One step:
  1. rollouts: for each of `prompts_per_step` prompts, `samples_per_prompt` completions, all decoded together,
     by speculative decoding with the current head: a mixture head samples from the ensemble
     nu_t = w_t p_t + (1 - w_t) q_t (rule "dynamic": every emitted token but the bonus tokens is distributed
     exactly as nu_t), a lenience head verifies with rule "lossy" at its L_t;
     the decoding keeps, at every emitted token, what the verifier saw there (Trace, through on_round):
     both models' hidden states, p_t(y_t), q_t(y_t), TV(q_t, p_t) and the drafted token's numbers and verdict,
     so the models never run again for it
     (a teacher-forced pass over the completions took as long as sampling them);
  2. rewards R(y) from the task, and advantages R - b, b the mean reward of the other samples of the prompt;
  3. the sampling head's w_t (or L_t) on the stored (float16) inputs;
  4. all that is stored (diversed.head.rollouts: rollouts/step-NNNNNN.safetensors + .json), so the models
     never run again for it: a killed run resumes without redoing the rollouts already stored;
  5. `ppo_epochs` passes over the stored rollouts in `minibatches` random minibatches of completions, each an
     AdamW update of the clipped surrogate plus the acceptance term (diversed.head.ppo, which says why the
     importance ratio is per token). With ppo_epochs = 1 and one minibatch the update is REINFORCE's:
     -(R - b) * sum_t log nu_t(y_t) - lambda * A'(y) (for a lenience head, log of the verdicts' probabilities).
Only the head trains. A checkpoint (head, optimizer, step) is written at the start and every
`checkpoint_every` steps; a resumed run redoes the updates of the steps after its checkpoint from their
stored rollouts, so no rollout is sampled twice and no update applied twice.
"""

from __future__ import annotations

import json
import random
import shutil
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from datetime import datetime, timezone
from pathlib import Path
from typing import Protocol

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor
from tqdm import tqdm

from diversed.decoding.engine import Round, decode
from diversed.folders import changed_settings, check_writable, saved_settings
from diversed.head.config import TrainConfig
from diversed.head.model import FEATURES, EnsembleHead, HeadConfig, build, token_features
from diversed.head.names import CONFIG_FILE, head_folder
from diversed.head.ppo import ppo_terms, rejection, term_gradient_norms
from diversed.head.rollouts import ROLLOUTS, Rollouts, informative_rows, leave_one_out
from diversed.models.loading import Pair
from diversed.request import Drafting, Sampling, Verification
from diversed.tasks.task import predicted_outputs
from diversed.text import cut_at_stop, encode_prompt, stop_checker
from diversed.verify import point_masses, total_variation


class Task(Protocol):
    """What training needs of a task (diversed.tasks): examples with an .id and a .prompt, a reward, stop strings."""

    name: str
    stop: Sequence[str]

    def examples(self, split: str, limit: int | None = None) -> list: ...

    def reward(self, example, completion: str) -> float: ...


STATE_FILE, OPTIMIZER_FILE, LOG_FILE = "train_state.json", "optimizer.safetensors", "log.jsonl"
CHECKPOINT = "checkpoint"  # the folder of the last checkpoint inside a training run's output


def train_head(pair: Pair, task: Task, config: TrainConfig, out_dir: str | Path, *, resume: bool = False,
               until_step: int | None = None, progress: bool = True) -> EnsembleHead:
    """Train a head for the pair on the task's training split; write the rollouts, checkpoints, a JSONL log
    (one line per step: the rollouts' reward, acceptance proxy A, measured acceptance rate, mean w and its
    spread over tokens; both loss terms and their gradient norms, the clip fraction and the approximate KL
    between the sampling head and the updated one) and the final head to out_dir.

    With resume=True, continue from the last checkpoint in out_dir (the same config is required). With
    until_step, stop after that step (with a checkpoint, and the head so far written as the run's head; its
    head.json says how many steps it has had): a later resume continues the same run."""
    if until_step is not None and until_step < 1:
        raise ValueError(f"until_step must be >= 1, got {until_step}")
    out_dir = Path(out_dir)
    check_run_folder(out_dir, config, resume)
    examples = task.examples("train", limit=config.limit)
    if not examples:
        raise ValueError(f"task {task.name!r} has no training examples")
    head_config = HeadConfig(
        pair.draft.hidden_size, pair.target.hidden_size, config.architecture,
        initial_weight=config.initial_weight, draft_model=pair.draft_name, target_model=pair.target_name,
        training={**asdict(config), "task": task.name, "examples": len(examples)}, kind=config.kind,
        max_lenience=config.max_lenience, initial_lenience=config.initial_lenience)
    head = build(head_config).to(pair.target.device)
    optimizer = torch.optim.AdamW(head.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    if config.init_head is not None and not resume:  # a resumed run takes its weights from its checkpoint
        _warm_start(head_folder(config.init_head), head, optimizer, pair)
    steps_per_epoch = -(-len(examples) // config.prompts_per_step)
    total_steps = steps_per_epoch * config.epochs
    step = _resume(out_dir, head, optimizer, config) if resume else _start(out_dir, head, optimizer, config)

    sampling = Sampling(config.temperature)
    ids = [encode_prompt(pair.tokenizer, e.prompt_for(pair.tokenizer.chat_template is not None)) for e in examples]
    predictions = ([pair.tokenizer(text, add_special_tokens=False)["input_ids"]
                    for text in predicted_outputs(task.name, examples)] if config.drafter == "prediction" else None)
    last = total_steps if until_step is None else min(until_step, total_steps)
    bar = tqdm(total=total_steps, initial=step, desc="training head", disable=not progress, dynamic_ncols=True)
    while step < last:
        epoch, index = divmod(step, steps_per_epoch)
        order = list(range(len(examples)))
        random.Random(config.seed + epoch).shuffle(order)  # a function of (seed, epoch): resumable
        chosen = order[index * config.prompts_per_step:(index + 1) * config.prompts_per_step]
        started = time.perf_counter()
        # Seeds are functions of the step: a resumed run samples and shuffles as the uninterrupted one did.
        seed = config.seed * 1_000_003 + step
        rollouts = _rollouts(pair, head, [ids[i] for i in chosen], [examples[i] for i in chosen],
                             None if predictions is None else [predictions[i] for i in chosen], task, config,
                             sampling, seed, out_dir / ROLLOUTS, step + 1)
        with torch.no_grad():
            rejected = rejection(head, rollouts.old_w, rollouts)
        record = {**rollouts.summary(rejected), **_update(head, optimizer, rollouts, config, seed)}
        step += 1
        record = {"step": step, "epoch": epoch, **record, "seconds": time.perf_counter() - started}
        with open(out_dir / LOG_FILE, "a") as log:
            log.write(json.dumps(record) + "\n")
        bar.update()
        bar.set_postfix(reward=f"{record['reward']:.2f}", accept=f"{record['acceptance']:.2f}",
                        w=f"{record['mean_w']:.2f}", kl=f"{record['approx_kl']:.1e}")
        if step % config.checkpoint_every == 0 or step == last:
            _checkpoint(out_dir, head, optimizer, step, config)
    bar.close()
    head.config.training["date"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    head.config.training["steps"], head.config.training["total_steps"] = step, total_steps
    head.save(out_dir)
    return head


def _rollouts(pair: Pair, head: EnsembleHead, prompt_ids: list[list[int]], examples: list,
              predictions: list[list[int]] | None, task: Task, config: TrainConfig, sampling: Sampling, seed: int,
              folder: Path, step: int) -> Rollouts:
    """The step's rollouts: the stored ones if this step's were stored before a kill, else new ones, stored."""
    stored = Rollouts.load(folder, step, pair.target.device)
    if stored is not None:
        expected = [e.id for e in examples for _ in range(config.samples_per_prompt)]
        if [c["example"] for c in stored.info["completions"]] != expected:
            raise ValueError(f"the rollouts stored for step {step} in {folder} are of other prompts")
        return stored
    rollouts = _collect(pair, head, prompt_ids, examples, predictions, task, config, sampling, seed)
    rollouts.save(folder, step)
    return rollouts


@dataclass
class Trace:
    """What the verifier saw at each token a job emitted: the draft's and the target's last hidden states that
    predicted it, p(y) and q(y) as the rule used them, TV(q, p), the FEATURES of the token drafted there
    (diversed.head.model: y itself where it was kept, the rejected draft where y is the correction) and
    whether it was kept. Training keeps its rollouts this way instead of running both models over them again,
    through decode's on_round. A bonus token (drawn from p after a fully kept round, not from the rule's
    target) had no draft: there the draft's state and the features are zeros, q(y) is p(y), TV is 0, and
    `bonus` is true. So are the tokens of a step of the target alone (a round in which no copying drafter
    proposed anything for any row), but for p(y), not seen there, and the target's state: zeros too (nothing
    reads them at a bonus token)."""

    target_hidden: int  # the target's hidden size: the width of its (zero) state at a step of the target alone
    device: torch.device
    parts: list[tuple[Tensor, ...]] = field(default_factory=list)

    def add(self, result: Round | None, row: int, count: int) -> None:
        """The first `count` tokens that `row` emitted in this round (its kept drafts, then the next token);
        result None: a step of the target alone."""
        if count == 0:
            return
        if result is None:
            self._add_target_step(count)
            return
        kept, drafted = int(result.verdict.num_accepted[row]), int(result.lengths[row])
        tokens = torch.cat([result.drafts[row, :kept], result.verdict.next_token[row:row + 1]])[:count]
        scored = min(count, drafted)  # a bonus token, if any, is the last
        p = result.p[row, :count]
        q = point_masses(result.drafts[row, :scored], p.shape[-1]) if result.q is None else result.q[row, :scored]
        p_y = p.gather(-1, tokens.to(p.device)[:, None]).squeeze(-1)
        q_y = torch.cat([q.gather(-1, tokens[:scored].to(q.device)[:, None]).squeeze(-1), p_y[scored:]])
        tv = torch.cat([total_variation(q, p[:scored]), p_y.new_zeros(count - scored)])
        if result.h_draft is None:  # a lenience head's rounds: nothing reads the draft's states
            h_draft = p.new_zeros(count, 0)
        else:
            h_draft = result.h_draft[row, :scored]
            h_draft = torch.cat([h_draft, h_draft.new_zeros(count - scored, h_draft.shape[-1])])
        features = token_features(result.drafts[row, :scored], q, p[:scored])
        features = torch.cat([features, features.new_zeros(count - scored, features.shape[-1])])
        position = torch.arange(count, device=p_y.device)
        self.parts.append((h_draft, result.h_target[row, :count], p_y, q_y, tv, features, position < kept,
                           position >= scored))

    def _add_target_step(self, n: int) -> None:
        """Trace n tokens of a step of the target alone as bonus tokens of zeros (the draft's state as wide as
        the others')."""
        width, device = self.parts[-1][0].shape[-1] if self.parts else 0, self.device
        zeros = torch.zeros(n, device=device)
        self.parts.append((torch.zeros(n, width, device=device), torch.zeros(n, self.target_hidden, device=device),
                           zeros, zeros, zeros, torch.zeros(n, len(FEATURES), device=device),
                           torch.zeros(n, dtype=torch.bool, device=device),
                           torch.ones(n, dtype=torch.bool, device=device)))

    def tensors(self) -> tuple[Tensor, ...]:
        """h_draft [T, d_draft], h_target [T, d_target], p_y, q_y, tv [T], features [T, 5], kept and bonus [T]
        over the job's T tokens."""
        if not self.parts:
            raise ValueError("the trace is empty: the job emitted no token")
        return tuple(torch.cat(column) for column in zip(*self.parts, strict=True))


def _collect(pair: Pair, head: EnsembleHead, prompt_ids: list[list[int]], examples: list,
             predictions: list[list[int]] | None, task: Task, config: TrainConfig, sampling: Sampling, seed: int
             ) -> Rollouts:
    """Sample samples_per_prompt completions of each prompt in one decode call, keeping what the verifier saw at
    each token, and reward them."""
    started = time.perf_counter()
    k = config.samples_per_prompt
    batch = [p for p in prompt_ids for _ in range(k)]
    # A constant draft length: every round in which the drafter proposes anything is speculative (the draft
    # model always does), so the traces cover every drafted token.
    traces = [Trace(pair.target.hidden_size, pair.target.device) for _ in batch]
    generation = decode(pair.target, batch, draft=pair.draft, drafter=config.drafter,
                        verification=Verification("dynamic"), sampling=sampling,
                        drafting=Drafting(config.draft_length), max_new_tokens=config.max_new_tokens,
                        eos_token_ids=pair.eos_token_ids, head=head, seed=seed,
                        stop=stop_checker(pair.tokenizer, task.stop),
                        predictions=None if predictions is None else [p for p in predictions for _ in range(k)],
                        on_round=lambda i, result, row, count: traces[i].add(result, row, count),
                        # A resumed run repeats the uninterrupted one to the bit; a cached prefix's last bits
                        # depend on what the process read before.
                        cache_prompt=False)
    texts = [cut_at_stop(pair.tokenizer.decode(t, skip_special_tokens=True), task.stop) for t in generation.tokens]
    rewards = [task.reward(examples[i // k], text) for i, text in enumerate(texts)]
    device = pair.target.device
    traced = [trace.tensors() for trace in traces]
    if any(len(k[0]) != len(t) for k, t in zip(traced, generation.tokens, strict=True)):
        raise RuntimeError("a trace missed tokens of its completion")
    h_draft, h_target, p_y, q_y, tv, features, kept, bonus = (torch.cat(column).to(device)
                                                               for column in zip(*traced, strict=True))
    h_draft, h_target = h_draft.half(), h_target.half()
    if not (h_draft.isfinite().all() and h_target.isfinite().all()):
        raise ValueError("the models' hidden states overflow float16, the rollouts' storage type")
    with torch.no_grad():  # the sampling head's w on exactly the stored inputs: the ratio starts at exactly 1
        old_w = head(h_draft.float(), h_target.float(), features)
    reward = torch.tensor(rewards, dtype=torch.float32, device=device)
    lengths = torch.tensor([len(t) for t in generation.tokens], device=device)
    summary = generation.summary()
    completions = [{"example": examples[i // k].id, "reward": r, "text": text}
                   for i, (r, text) in enumerate(zip(rewards, texts, strict=True))]
    return Rollouts(h_draft=h_draft, h_target=h_target,
                    token=torch.tensor([t for row in generation.tokens for t in row], device=device),
                    p_y=p_y.float(), q_y=q_y.float(), tv=tv.float(), features=features, kept=kept, bonus=bonus,
                    old_w=old_w,
                    sequence=torch.repeat_interleave(torch.arange(len(batch), device=device), lengths),
                    reward=reward, advantage=leave_one_out(reward, k),
                    mean_tv=tv[~bonus].mean().nan_to_num().item(),
                    info={"seed": seed, "acceptance_rate": summary["acceptance_rate"],
                          "new_tokens": summary["new_tokens"], "seconds": time.perf_counter() - started,
                          "completions": completions})


def _update(head: EnsembleHead, optimizer: torch.optim.Optimizer, rollouts: Rollouts, config: TrainConfig,
            seed: int) -> dict:
    """ppo_epochs passes over the rollouts (with informative_only, over those of prompts whose samples' rewards
    differ), each in `minibatches` random minibatches of completions, one AdamW update each. Returns what the
    log reports: the completions updated on, the terms' gradient norms at the sampling head, the losses,
    gradient norm and clip fraction averaged over the updates, and the approximate KL after them."""
    if config.informative_only:
        rollouts = rollouts.select(informative_rows(rollouts.reward, config.samples_per_prompt))
    sequences = len(rollouts.reward)
    if sequences == 0:  # nothing the reward can object to: no update at all
        return {"trained_on": 0, "pg_grad_norm": 0.0, "acceptance_grad_norm": 0.0, "pg_loss": 0.0,
                "acceptance_term": 0.0, "loss": 0.0, "grad_norm": 0.0, "clip_fraction": 0.0, "approx_kl": 0.0,
                "updates": 0}
    record = {"trained_on": sequences, **term_gradient_norms(head, rollouts, config.lam, config.clip)}
    size = -(-sequences // config.minibatches)
    generator = torch.Generator().manual_seed(seed)
    totals = dict.fromkeys(("pg_loss", "acceptance_term", "loss", "grad_norm", "clip_fraction"), 0.0)
    updates = 0
    for _ in range(config.ppo_epochs):
        order = torch.randperm(sequences, generator=generator)
        for start in range(0, sequences, size):
            terms = ppo_terms(head, rollouts.select(order[start:start + size]), config.lam, config.clip)
            loss = terms.pg_loss + terms.acceptance_term
            optimizer.zero_grad()
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(head.parameters(), config.grad_clip)
            optimizer.step()
            for name, value in (("pg_loss", terms.pg_loss.item()), ("acceptance_term", terms.acceptance_term.item()),
                                ("loss", loss.item()), ("grad_norm", grad_norm.item()),
                                ("clip_fraction", terms.clip_fraction)):
                totals[name] += value
            updates += 1
    with torch.no_grad():
        approx_kl = ppo_terms(head, rollouts, config.lam, config.clip).approx_kl
    return {**record, **{name: total / updates for name, total in totals.items()}, "approx_kl": approx_kl,
            "updates": updates}


def check_run_folder(out_dir: str | Path, config: TrainConfig, resume: bool) -> None:
    """Refuse, before any model loads or anything is written, an out_dir that cannot take this run: one that
    is (or lies under) a file, one that holds a run when resume is False, one with nothing to resume or a
    run of another config when resume is True."""
    out_dir = Path(out_dir)
    check_writable(out_dir, "the training run")
    if not resume:
        if any((out_dir / n).exists() for n in (CHECKPOINT, CHECKPOINT + ".old", LOG_FILE, CONFIG_FILE, ROLLOUTS)):
            raise ValueError(f"{out_dir} already holds a training run: pass resume=True (--resume) or another --out")
        return
    folder = _checkpoint_folder(out_dir)
    if folder is None:
        raise FileNotFoundError(f"nothing to resume in {out_dir}: no checkpoint")
    # A run saved before a setting existed ran with its default.
    saved = {f.name: f.default for f in fields(TrainConfig)} | saved_settings(
        json.loads((folder / STATE_FILE).read_text())["config"])
    if changed := changed_settings(saved, asdict(config)):
        raise ValueError(f"cannot resume {out_dir} with a different config (changed: {', '.join(changed)})")


def _checkpoint_folder(out_dir: Path) -> Path | None:
    """The last complete checkpoint (checkpoint, or checkpoint.old during a swap), if any."""
    return next((out_dir / n for n in (CHECKPOINT, CHECKPOINT + ".old") if (out_dir / n / STATE_FILE).exists()),
                None)


def _start(out_dir: Path, head: EnsembleHead, optimizer: torch.optim.Optimizer, config: TrainConfig) -> int:
    """Begin a run in an empty out_dir with a checkpoint of step 0: a run killed before its first regular
    checkpoint then resumes too, from its stored rollouts, and under the same config only."""
    out_dir.mkdir(parents=True, exist_ok=True)
    _checkpoint(out_dir, head, optimizer, 0, config)
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
    folder = _checkpoint_folder(out_dir)  # check_run_folder made sure there is one, of this config
    state = json.loads((folder / STATE_FILE).read_text())
    head.load_state_dict(EnsembleHead.load(folder).state_dict())
    _load_optimizer(folder, optimizer)
    # Drop log lines written after the checkpoint, and a line a kill cut short, so the log matches the
    # resumed run exactly.
    log = out_dir / LOG_FILE
    if log.exists():
        lines = [ln for ln in log.read_text().splitlines()
                 if (entry := _log_entry(ln)) is not None and entry["step"] <= state["step"]]
        log.write_text("".join(ln + "\n" for ln in lines))
    return state["step"]


def _log_entry(line: str) -> dict | None:
    """A log line's entry, or None for a blank line or one cut short."""
    try:
        entry = json.loads(line)
    except json.JSONDecodeError:
        return None
    return entry if isinstance(entry, dict) and "step" in entry else None


def _warm_start(folder: Path, head: EnsembleHead, optimizer: torch.optim.Optimizer, pair: Pair) -> None:
    """Start from the head in folder (refusing one of other models); from a checkpoint folder, from its
    AdamW moments too: fresh moments would make the first updates full-size sign steps whatever the
    gradient's scale, as if the head had never been trained."""
    start = EnsembleHead.load(folder, draft_hidden=pair.draft.hidden_size, target_hidden=pair.target.hidden_size,
                              draft_model=pair.draft_name, target_model=pair.target_name)
    head.load_state_dict(start.state_dict())
    if (folder / OPTIMIZER_FILE).is_file():
        _load_optimizer(folder, optimizer)


def _load_optimizer(folder: Path, optimizer: torch.optim.Optimizer) -> None:
    """Load the AdamW moments and step counts of a checkpoint folder into optimizer (its settings stay)."""
    state = json.loads((folder / STATE_FILE).read_text())
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

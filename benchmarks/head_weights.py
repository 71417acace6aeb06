"""Where a head is strict and where it is lenient: its w, token by token, on completions of held-out prompts.

The paper's argument for a learned weight is that w should be high (trust the target) where a wrong token
would change the answer, and low (take the draft) elsewhere. This measures it: one teacher-forced pass of
both models over given completions gives, at every token, the models' disagreement TV(q, p) and each head's
w; tokens are grouped by kind (digits, operators, words or code names, keywords, whitespace, punctuation),
by position in the completion (the first token often decides how an answer starts) and by how much the
models disagree. Every head sees the same completions, so heads compare directly, and a
static weight in disguise shows the same w for every kind. Intervals resample completions (the tokens of one
completion are not independent).
"""

from __future__ import annotations

import json
import keyword
import re
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from scipy.stats import bootstrap
from torch import Tensor
from tqdm import tqdm

from diversed.decoding.sampling import probabilities
from diversed.head.model import EnsembleHead, token_features
from diversed.models.loading import Pair
from diversed.request import Sampling
from diversed.text import encode_prompt

KINDS = ("digits", "operators", "words", "code names", "keywords", "whitespace", "punctuation", "other")
TV_BINS = (0.0, 0.01, 0.1, 0.5, 1.0)  # TV(q, p): the models agree / nearly / differ / disagree
POSITIONS = ((0, 1, "token 1"), (1, 10, "tokens 2-10"), (10, None, "tokens 11+"))  # where in the completion
_OPERATORS = re.compile(r"[+\-*/=<>%^×÷·]+|\\(?:times|div|cdot|frac|le|ge|neq|approx)")
_BOOTSTRAP_RESAMPLES, _BOOTSTRAP_SEED = 2000, 0


def token_kind(text: str, code: bool) -> str:
    """The kind of one token, from its text; code=True names identifiers "code names" (and tells Python's
    keywords apart), code=False calls them "words"."""
    core = text.strip()
    if not core:
        return "whitespace"
    if re.fullmatch(r"[\d.,]*\d[\d.,]*", core):
        return "digits"
    if _OPERATORS.fullmatch(core):
        return "operators"
    if code and keyword.iskeyword(core):
        return "keywords"
    if re.fullmatch(r"[A-Za-z_]\w*", core):
        return "code names" if code else "words"
    if re.fullmatch(r"[^\w\s]+", core):
        return "punctuation"
    return "other"


@dataclass
class Scores:
    """What a teacher-forced pass of both models gives at each generated position t of some completions
    ([B, T], padded; on the target's device): the draft's and target's last hidden states that predict y_t
    (float32, [B, T, d]), diversed.head.model's FEATURES of y_t as if it were drafted ([B, T, 5]: p(y_t), max p,
    H(p), q(y_t), TV(q, p)), the mask of real positions, and the mask of positions whose token came from the
    ensemble (not a bonus token)."""

    h_draft: Tensor
    h_target: Tensor
    features: Tensor
    mask: Tensor
    scored: Tensor

    @property
    def p_y(self) -> Tensor:
        return self.features[..., 0]

    @property
    def q_y(self) -> Tensor:
        return self.features[..., 3]

    @property
    def tv(self) -> Tensor:
        return self.features[..., 4]


@torch.no_grad()
def score_completions(pair: Pair, prompts: list[list[int]], completions: list[list[int]],
                      bonus: list[list[bool]], sampling: Sampling, rows_per_pass: int = 2,
                      progress: bool = False) -> Scores:
    """Teacher-forced pass of both models over prompt + completion (Scores). `rows_per_pass` sequences go
    through the models at a time: the full distributions of a pass take rows x T x V floats (2 x 400 x 152k is
    0.5 GB per model). `progress` shows a bar over the sequences (on a CPU, a few seconds each).
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
    parts = []
    with tqdm(total=len(fed), desc="scoring completions", unit="seq", disable=not progress,
              dynamic_ncols=True) as bar:
        for start in range(0, len(fed), rows_per_pass):
            chunk = slice(start, start + rows_per_pass)
            (h_draft, q), (h_target, p) = [
                (hidden.float().to(device), probabilities(sampling, logits).to(device))
                for hidden, logits in (model.rows(len(fed[chunk])).feed(fed[chunk], length, hidden=True)
                                       for model in (pair.draft, pair.target))]
            parts.append((h_draft, h_target, token_features(torch.tensor(padded[chunk], device=device), q, p)))
            bar.update(len(fed[chunk]))
    h_draft, h_target, features = (torch.cat(column) for column in zip(*parts, strict=True))
    return Scores(h_draft, h_target, features, mask.to(device), (scored & mask).to(device))


@dataclass
class TokenWeights:
    """Every scored token of some completions: which completion it is in, its text and kind, TV(q, p), and
    each head's value (by head name): w for a mixture head, L for the lenience heads named in `lenience`."""

    completion: Tensor  # [N] long
    text: list[str]
    kind: list[str]
    tv: Tensor  # [N]
    w: dict[str, Tensor]  # head name -> [N]
    lenience: set[str] = field(default_factory=set)


@torch.no_grad()
def token_weights(pair: Pair, heads: Mapping[str, EnsembleHead], prompts: Sequence[str], completions: Sequence[str],
                  *, temperature: float, code: bool, progress: bool = False) -> TokenWeights:
    """Each head's value (w, or L) and the models' TV(q, p) (at this temperature) at every token of the
    completions, which are re-tokenized from their text and read after their prompts (empty completions are
    skipped); `progress` shows a bar over the completions."""
    if len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
    if not heads:
        raise ValueError("no head to inspect")
    kept = [i for i, c in enumerate(completions) if c]
    if not kept:
        raise ValueError("every completion is empty: no token to inspect")
    prompt_ids = [encode_prompt(pair.tokenizer, prompts[i]) for i in kept]
    tokens = [pair.tokenizer(completions[i], add_special_tokens=False)["input_ids"] for i in kept]
    scores = score_completions(pair, prompt_ids, tokens, [[False] * len(t) for t in tokens], Sampling(temperature),
                               progress=progress)
    texts = [pair.tokenizer.decode([t]) for row in tokens for t in row]
    mask = scores.mask
    return TokenWeights(
        completion=torch.repeat_interleave(torch.arange(len(tokens)), torch.tensor([len(t) for t in tokens])),
        text=texts, kind=[token_kind(t, code) for t in texts], tv=scores.tv[mask].float().cpu(),
        w={name: head(scores.h_draft, scores.h_target, scores.features)[mask].float().cpu()
           for name, head in heads.items()},
        lenience={name for name, head in heads.items() if head.config.kind != "mixture"})


def weights_table(weights: TokenWeights) -> list[dict]:
    """Per head, per group of tokens (all, each kind, each position range, each TV bin): tokens, their share,
    the head's mean value (w, or L) with a 95% bootstrap interval over completions, mean TV(q, p), and for a
    mixture head mean w * TV, the expected rejection rate of a drafted token there (exact's is the mean TV;
    None for a lenience head, whose rejections need the whole distributions)."""
    groups: list[tuple[str, Tensor]] = [("all", torch.ones_like(weights.tv, dtype=torch.bool))]
    kinds = np.array(weights.kind)
    groups += [(kind, torch.from_numpy(kinds == kind)) for kind in KINDS if (kinds == kind).any()]
    counts = torch.bincount(weights.completion)
    position = torch.arange(len(weights.tv)) - (torch.cumsum(counts, 0) - counts)[weights.completion]
    for start, end, name in POSITIONS:
        inside = (position >= start) & ((position < end) if end is not None else True)
        if inside.any():
            groups.append((name, inside))
    for low, high in zip(TV_BINS, TV_BINS[1:], strict=False):
        inside = (weights.tv >= low) & ((weights.tv < high) if high < 1 else (weights.tv <= high))
        if inside.any():
            groups.append((f"TV {low:g}-{high:g}", inside))
    rows = []
    for head, w in weights.w.items():
        for group, inside in groups:
            low, high = _completion_bootstrap(w, weights.completion, inside)
            rows.append({"head": head, "group": group, "tokens": int(inside.sum()),
                         "share": inside.float().mean().item(), "mean_w": w[inside].mean().item(),
                         "mean_w_low": low, "mean_w_high": high, "mean_tv": weights.tv[inside].mean().item(),
                         "expected_rejection": None if head in weights.lenience
                         else (w * weights.tv)[inside].mean().item()})
    return rows


def _completion_bootstrap(values: Tensor, completion: Tensor, inside: Tensor) -> tuple[float | None, float | None]:
    """95% percentile interval of the mean of values[inside], resampling completions (a ratio of sums)."""
    count = completion.max().item() + 1
    sums = torch.zeros(count).index_add_(0, completion[inside], values[inside]).numpy()
    counts = torch.bincount(completion[inside], minlength=count).float().numpy()
    if (counts > 0).sum() < 2:
        return None, None

    def ratio(s, c, axis=-1):
        return s.sum(axis=axis) / np.maximum(c.sum(axis=axis), 1e-12)

    with warnings.catch_warnings():  # a head that is one constant w gives a degenerate (but right) interval
        warnings.simplefilter("ignore")
        result = bootstrap((sums, counts), ratio, paired=True, vectorized=True, n_resamples=_BOOTSTRAP_RESAMPLES,
                           method="percentile", rng=np.random.default_rng(_BOOTSTRAP_SEED))
    low, high = result.confidence_interval
    return float(low), float(high)


def weights_markdown(rows: Sequence[dict]) -> str:
    """The table as Markdown, one block of rows per head."""
    lines = ["| head | group of tokens | tokens | share | mean w or L (95% CI) | mean TV(q, p) | mean w * TV |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        interval = "" if r["mean_w_low"] is None else f" ({r['mean_w_low']:.3f}-{r['mean_w_high']:.3f})"
        lines.append(f"| {r['head']} | {r['group']} | {r['tokens']} | {100 * r['share']:.1f}% | "
                     f"{r['mean_w']:.3f}{interval} | {r['mean_tv']:.3f} | "
                     f"{'-' if r['expected_rejection'] is None else format(r['expected_rejection'], '.4f')} |")
    return "\n".join(lines)


def plot_weights(rows: Sequence[dict], out: str | Path) -> Path:
    """Mean w by kind of token, by position in the completion and by the models' disagreement, one bar per
    head, with the intervals and each group's share of the tokens, in one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    heads = list(dict.fromkeys(r["head"] for r in rows))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4), gridspec_kw={"width_ratios": [3, 1.5, 2]})
    for ax, panel, title in ((axes[0], "kind", "mean w by kind of token"),
                             (axes[1], "position", "by position in the completion"),
                             (axes[2], "TV", "by disagreement TV(q, p)")):
        groups = list(dict.fromkeys(r["group"] for r in rows if r["group"] != "all" and _panel(r["group"]) == panel))
        width = 0.8 / len(heads)
        for i, head in enumerate(heads):
            mine = {r["group"]: r for r in rows if r["head"] == head}
            x = [j + i * width for j, g in enumerate(groups) if g in mine]
            shown = [mine[g] for g in groups if g in mine]
            error = [[r["mean_w"] - (r["mean_w_low"] if r["mean_w_low"] is not None else r["mean_w"]) for r in shown],
                     [(r["mean_w_high"] if r["mean_w_high"] is not None else r["mean_w"]) - r["mean_w"]
                      for r in shown]]
            ax.bar(x, [r["mean_w"] for r in shown], width, yerr=error, capsize=2, label=head)
        share = {r["group"]: r["share"] for r in rows}
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(groups))],
                      [f"{g} ({100 * share[g]:.0f}%)" for g in groups], rotation=30, ha="right")
        ax.set_ylim(0, 1)
        ax.set_ylabel("w (weight on the target) or L (lenience)")
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return Path(out)


def _panel(group: str) -> str:
    return "TV" if group.startswith("TV") else "position" if group.startswith("token") else "kind"


def write_weights_report(weights: TokenWeights, out_dir: str | Path, header: str = "") -> list[dict]:
    """head_weights.{md,json,png} in out_dir, plus the tokens each head trusts the draft least and most with."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = weights_table(weights)
    extremes = []
    for head, w in weights.w.items():
        order = w.argsort()  # a lenience head is most lenient where L is highest, a mixture head where w is lowest
        lenient, strict = (order.flip(0), order) if head in weights.lenience else (order, order.flip(0))
        letter = "L" if head in weights.lenience else "w"
        for title, picks in ((f"{'highest' if letter == 'L' else 'lowest'} {letter} (most lenient)", lenient[:15]),
                             (f"{'lowest' if letter == 'L' else 'highest'} {letter} (strictest)", strict[:15])):
            extremes.append(f"{head}, {title}: " + ", ".join(f"{weights.text[i]!r} {w[i]:.2f}" for i in picks.tolist()))
    (out_dir / "head_weights.json").write_text(json.dumps(rows, indent=1) + "\n")
    (out_dir / "head_weights.md").write_text((header + "\n\n" if header else "") + weights_markdown(rows) + "\n\n"
                                             + "\n\n".join(extremes) + "\n")
    plot_weights(rows, out_dir / "head_weights.png")
    return rows

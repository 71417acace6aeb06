"""Which disagreements change the answer, and does a head's w know: one draft token swapped into the target's
own greedy completion at a time, the rest written by the target, and the answer checked.

For each held-out problem (the first ones of the test split, in order, whose greedy target completion is
right): at every position t where the draft's most likely token d_t differs from the target's y_t, the
target continues greedily from y_<t + d_t (the same 512-token budget, the task's stop strings), and the
flip is harmful if that answer is wrong. At a low temperature this is exactly the choice a relaxed rule
makes there: the draft proposes d_t, and the ensemble w p + (1 - w) q keeps it with probability about 1 - w.
So a head that knows which flips matter puts a high w on the harmful ones: the report gives, per head, the
AUC of w for harm (with 95% intervals resampling problems, whose flips are not independent), the harm rate
among the flips it keeps against a static weight keeping as many, and the share of flips that are harmless
(what an oracle head could keep for free). Resumable: one line per problem in --out/flips.jsonl.

    .venv/bin/python benchmarks/flip_harm.py --task gsm8k --problems 40 --out benchmarks/results/gsm8k-t0.1/flips \\
        --head gsm8k=gsm8k --head lambda0.01=benchmarks/results/train-gsm8k-t0.1-lambda0.01/head-step-13
    .venv/bin/python benchmarks/flip_harm.py --out benchmarks/results/gsm8k-t0.1/flips --report
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
from head_weights import score_completions, token_kind
from scipy.stats import mannwhitneyu
from tqdm import tqdm

from diversed.admission import load_head
from diversed.decoding.engine import decode
from diversed.models.loading import load_pair
from diversed.request import Sampling, Verification
from diversed.tasks import get_task
from diversed.text import cut_at_stop, encode_prompt, stop_checker

FLIPS_FILE, TEMPERATURE, MAX_NEW_TOKENS, BATCH = "flips.jsonl", 0.1, 512, 4
_RESAMPLES, _SEED = 2000, 0


def greedy(pair, prompts: list[list[int]], max_new_tokens: list[int], stop) -> list[list[int]]:
    """The target's greedy continuation of each prompt, BATCH rows at a time (each with its own budget)."""
    out = []
    for start in range(0, len(prompts), BATCH):
        chunk = slice(start, start + BATCH)
        out += decode(pair.target, prompts[chunk], verification=Verification("plain"), sampling=Sampling(0.0),
                      max_new_tokens=max(max_new_tokens[chunk]), eos_token_ids=pair.eos_token_ids, stop=stop).tokens
    return [tokens[:budget] for tokens, budget in zip(out, max_new_tokens, strict=True)]


@torch.no_grad()
def problem_flips(pair, task, example, heads: dict, stop) -> dict:
    """The greedy completion of one problem and, if it is right, every flip with its outcome and each head's w."""
    tokenizer = pair.tokenizer
    prompt = encode_prompt(tokenizer, example.prompt)

    def text_of(tokens: list[int]) -> str:
        return cut_at_stop(tokenizer.decode(tokens, skip_special_tokens=True), task.stop)

    base = greedy(pair, [prompt], [MAX_NEW_TOKENS], stop)[0]
    record = {"example": example.id, "tokens": len(base), "right": task.reward(example, text_of(base)) == 1.0}
    if not record["right"] or not base:
        return record
    record["completion"] = base  # so a head's inputs at each flip can be recomputed (flip_head.py)
    _, draft_logits = pair.draft.rows(1).feed([prompt + base[:-1]], len(base))
    drafted = draft_logits[0].argmax(-1).tolist()
    scores = score_completions(pair, [prompt], [base], [[False] * len(base)], Sampling(TEMPERATURE))
    h_draft, h_target, p_y, tv = scores.h_draft, scores.h_target, scores.p_y, scores.tv
    at = [t for t in range(len(base)) if drafted[t] != base[t]]
    # A kept end-of-sequence token ends the completion there: nothing to continue.
    going_on = [t for t in at if drafted[t] not in pair.eos_token_ids]
    continued = dict(zip(going_on, greedy(pair, [prompt + base[:t] + [drafted[t]] for t in going_on],
                                          [MAX_NEW_TOKENS - t - 1 for t in going_on], stop), strict=True))
    w = {name: head(h_draft, h_target)[0].tolist() for name, head in heads.items()}
    record["flips"] = []
    for t in at:
        target_text = tokenizer.decode([base[t]])
        flipped = text_of(base[:t] + [drafted[t]] + continued.get(t, []))
        record["flips"].append({
            "t": t, "target": target_text, "draft": tokenizer.decode([drafted[t]]),
            "kind": token_kind(target_text, task.metric == "pass@1"), "tv": tv[0, t].item(),
            "p_target": p_y[0, t].item(), "harmful": task.reward(example, flipped) < 1.0,
            "w": {name: values[t] for name, values in w.items()}})
    return record


def read_records(folder: Path) -> list[dict]:
    """The records of a flips folder, one a problem, in order (none if it has no flips file yet)."""
    path = folder / FLIPS_FILE
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def auc(scores: np.ndarray, harmful: np.ndarray) -> float:
    """P(score of a harmful flip > score of a harmless one), ties counted half (the Mann-Whitney U / n1 n0)."""
    return mannwhitneyu(scores[harmful], scores[~harmful]).statistic / (harmful.sum() * (~harmful).sum())


def report(records: list[dict]) -> str:
    """The Markdown table: flips, harm, and per head the AUC of w, the harm rate among the flips it keeps
    (weighted by 1 - w) against a static weight keeping as many (the overall harm rate), with intervals."""
    solved = [r for r in records if r["right"]]
    flips = [(i, f) for i, r in enumerate(solved) for f in r["flips"]]
    problem = np.array([i for i, _ in flips])
    harmful = np.array([f["harmful"] for _, f in flips])
    heads = list(flips[0][1]["w"]) if flips else []
    columns = {name: np.array([f["w"][name] for _, f in flips]) for name in heads}
    columns["target's p(y_t), T = 0.1 (no head)"] = np.array([f["p_target"] for _, f in flips])
    rng = np.random.default_rng(_SEED)
    draws = [np.concatenate([np.flatnonzero(problem == i) for i in rng.integers(0, len(solved), len(solved))])
             for _ in range(_RESAMPLES)]

    def interval(statistic) -> str:
        values = [statistic(d) for d in draws if 0 < harmful[d].sum() < len(d)]
        low, high = np.percentile(values, [2.5, 97.5])
        return f"{statistic(np.arange(len(harmful))):.3f} ({low:.3f}-{high:.3f})"

    lines = [f"{len(records)} problems read in order, {len(solved)} solved by the target's greedy completion; "
             f"{len(flips)} flips ({len(flips) / max(len(solved), 1):.1f} a problem), "
             f"{harmful.sum()} harmful: harm rate {interval(lambda d: harmful[d].mean())}; "
             f"problems with a harmful flip: {sum(any(f['harmful'] for f in r['flips']) for r in solved)}.", "",
             "| w from | AUC of w for harm (95% CI) | mean w, harmful flips | mean w, harmless "
             "| flips kept (sum of 1 - w) | harm rate among kept (95% CI) | vs a static weight keeping as many |",
             "|---|---|---|---|---|---|---|"]
    for name, w in columns.items():
        kept_harm = lambda d, w=w: ((1 - w[d]) * harmful[d]).sum() / (1 - w[d]).sum()  # noqa: E731
        lines.append(f"| {name} | {interval(lambda d, w=w: auc(w[d], harmful[d]))} | {w[harmful].mean():.3f} | "
                     f"{w[~harmful].mean():.3f} | {(1 - w).sum():.0f} of {len(w)} | {interval(kept_harm)} | "
                     f"{interval(lambda d, k=kept_harm: k(d) / harmful[d].mean())} |")
    kinds = sorted({f["kind"] for _, f in flips})
    lines += ["", "| kind of the target's token | flips | harmful | harm rate | "
              + " | ".join(f"mean w, {n}" for n in heads) + " |", "|---" * (4 + len(heads)) + "|"]
    for kind in kinds:
        inside = np.array([f["kind"] == kind for _, f in flips])
        lines.append(f"| {kind} | {inside.sum()} | {harmful[inside].sum()} | {harmful[inside].mean():.3f} | "
                     + " | ".join(f"{columns[n][inside].mean():.3f}" for n in heads) + " |")
    return "\n".join(lines)


def plot(records: list[dict], out: Path) -> None:
    """Each head's w on the harmful and on the harmless flips, side by side (one box pair per head)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    flips = [f for r in records if r["right"] for f in r["flips"]]
    heads = list(flips[0]["w"])
    fig, ax = plt.subplots(figsize=(2.2 * len(heads) + 1, 4))
    for i, name in enumerate(heads):
        for offset, harmful, color in ((-0.18, True, "tab:red"), (0.18, False, "tab:blue")):
            values = [f["w"][name] for f in flips if f["harmful"] == harmful]
            ax.boxplot(values, positions=[i + offset], widths=0.3, patch_artist=True,
                       boxprops={"facecolor": color, "alpha": 0.5}, medianprops={"color": "black"})
    ax.set_xticks(range(len(heads)), heads)
    ax.set_ylim(0, 1)
    ax.set_ylabel("w at the flip (weight on the target)")
    ax.set_title(f"w on harmful (red, {sum(f['harmful'] for f in flips)}) and harmless (blue, "
                 f"{sum(not f['harmful'] for f in flips)}) flips")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", default="gsm8k")
    parser.add_argument("--split", default="test", choices=("test", "train"),
                        help="read the test split (to measure heads) or the train split (labels to train one)")
    parser.add_argument("--problems", type=int, default=40, help="problems to read, the first ones in order")
    parser.add_argument("--head", action="append", default=[], metavar="NAME=DIR", help="a head to read (repeat)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--report", action="store_true", help="only write the report of the problems done")
    args = parser.parse_args()
    done = read_records(args.out)
    if not args.report:
        task = get_task(args.task)
        heads = dict(h.split("=", 1) for h in args.head) or {"gsm8k": "gsm8k"}
        pair = load_pair()
        loaded = {name: load_head(pair, directory) for name, directory in heads.items()}
        stop = stop_checker(pair.tokenizer, task.stop)
        args.out.mkdir(parents=True, exist_ok=True)
        todo = task.examples(args.split, limit=args.problems)[len(done):]
        with (args.out / FLIPS_FILE).open("a") as file:
            for example in tqdm(todo, desc="problems", initial=len(done), total=args.problems):
                done.append(problem_flips(pair, task, example, loaded, stop))
                file.write(json.dumps(done[-1]) + "\n")
                file.flush()
    text = report(done)
    (args.out / "flips.md").write_text(text + "\n")
    plot(done, args.out / "flips.png")
    print(text)


if __name__ == "__main__":
    main()

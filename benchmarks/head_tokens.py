"""Where a trained DIVERSED head is strict and where it is lenient: its weight w on the target, token by token,
on completions of held-out prompts.

The completions are sampled from the target itself (lossless "exact" speculative decoding), then one
teacher-forced pass of both models gives, at every generated token, the head's w, the models' disagreement
TV(q, p) and the expected rejection w * TV. Prints the spread of w, its correlation with TV, mean w by kind
of token, and the tokens the head trusts the draft least and most with. A head that is a static weight in
disguise shows a spread near 0 and the same w for every kind of token.

    .venv/bin/python benchmarks/head_tokens.py --head diversed/head/pretrained/humaneval --prompts 6
"""

from __future__ import annotations

import argparse
import keyword
import re
from collections import defaultdict

import torch

from diversed.decoding.sampling import Sampling
from diversed.generation import generate, load_head
from diversed.head.train import score_completions
from diversed.models.loading import load_pair
from diversed.tasks import get_task
from diversed.text import encode_prompt

KINDS = ("newline/indent", "keyword", "name", "number", "string quote", "operator/bracket", "other")


def token_kind(text: str) -> str:
    """A coarse kind for a Python token's text."""
    core = text.strip()
    if not core:
        return "newline/indent"
    if keyword.iskeyword(core):
        return "keyword"
    if re.fullmatch(r"[A-Za-z_]\w*", core):
        return "name"
    if re.fullmatch(r"\d+", core):
        return "number"
    if re.fullmatch(r"['\"]+.*|.*['\"]+", core):
        return "string quote"
    if re.fullmatch(r"[^\w\s]+", core):
        return "operator/bracket"
    return "other"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--head", help="folder of a trained head (default: the packaged one)")
    parser.add_argument("--task", default="humaneval")
    parser.add_argument("--prompts", type=int, default=6, help="held-out prompts to complete")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--max-new-tokens", type=int, default=160)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    pair = load_pair(backend="transformers")
    head = load_head(pair, args.head)
    task = get_task(args.task)
    examples = task.examples("test", limit=args.prompts)
    completions = generate(pair, [e.prompt for e in examples], method="exact", temperature=args.temperature,
                           max_new_tokens=args.max_new_tokens, stop=task.stop, seed=args.seed)
    ids = [encode_prompt(pair.tokenizer, e.prompt) for e in examples]
    tokens = [c.tokens for c in completions]
    h_draft, h_target, _, _, tv, mask, _ = score_completions(pair, ids, tokens, [[False] * len(t) for t in tokens],
                                                             Sampling(args.temperature))
    with torch.no_grad():
        w = head(h_draft, h_target)[mask]
    tv, texts = tv[mask], [pair.tokenizer.decode([t]) for row in tokens for t in row]

    print(f"# head {args.head or 'packaged'} on {len(examples)} held-out {task.name} prompts, T = {args.temperature}, "
          f"{len(texts)} tokens\n")
    corr = torch.corrcoef(torch.stack([w, tv]))[0, 1].item() if len(texts) > 1 else float("nan")
    print(f"w: mean {w.mean():.3f}, std over tokens {w.std():.3f}, min {w.min():.3f}, max {w.max():.3f}; "
          f"TV(q, p): mean {tv.mean():.3f}; corr(w, TV) {corr:+.2f}; expected rejection mean(w * TV) "
          f"{(w * tv).mean():.4f} (exact: {tv.mean():.4f})\n")
    by_kind: dict[str, list[int]] = defaultdict(list)
    for i, text in enumerate(texts):
        by_kind[token_kind(text)].append(i)
    print("| kind of token | tokens | mean w | mean TV(q, p) | mean w * TV |\n|---|---|---|---|---|")
    for kind in KINDS:
        if by_kind[kind]:
            wk, tvk = w[by_kind[kind]], tv[by_kind[kind]]
            print(f"| {kind} | {len(wk)} | {wk.mean():.3f} | {tvk.mean():.3f} | {(wk * tvk).mean():.4f} |")
    order = w.argsort()
    for title, picks in (("lowest w (most lenient)", order[:12]), ("highest w (strictest)", order.flip(0)[:12])):
        print(f"\n{title}: " + ", ".join(f"{texts[i]!r} {w[i]:.2f}" for i in picks.tolist()))


if __name__ == "__main__":
    main()

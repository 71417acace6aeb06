"""Our loop against transformers' assisted generation at the finest grain: the same prompts, greedy, the same
fixed number of drafts, taking turns prompt by prompt (the order reversing every prompt), with the time
inside each model's forwards measured by hooks. Greedy "exact" and transformers run the same rounds, so
any difference in speed is in the forwards or in the loops around them.

A third variant, "plain", is our loop with the models called as transformers calls them (no position ids,
no attention mask) wherever a batch has no holes: it tells whether our explicit ids and mask cost time.

    .venv/bin/python benchmarks/peer_ab.py --prompts 4 --repeats 2
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from diversed.backends.hf import TransformersRows
from diversed.decoding.engine import decode
from diversed.evaluation.peer import assisted_generate
from diversed.models.loading import Pair, load_pair
from diversed.request import Sampling, Verification
from diversed.tasks.humaneval import chat_prompt, load_humaneval
from diversed.text import encode_prompt


class ForwardTimer:
    """Seconds and calls inside a module's forward, by a pre- and a post-hook."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.seconds, self.calls, self._start = 0.0, 0, 0.0
        module.register_forward_pre_hook(lambda *_: setattr(self, "_start", time.perf_counter()))
        module.register_forward_hook(lambda *_: self._stop())

    def _stop(self) -> None:
        self.seconds += time.perf_counter() - self._start
        self.calls += 1


def plain_feed(feed: Callable) -> Callable:
    """TransformersRows.feed that calls the model without position ids and mask when no slot is a hole."""

    def fed(rows: TransformersRows, tokens, outputs, hidden=False):
        if not rows.valid.all() or len({len(t) for t in tokens}) > 1:
            return feed(rows, tokens, outputs, hidden)
        ids = torch.tensor([list(t) for t in tokens], device=rows.valid.device)
        rows.valid = torch.cat([rows.valid, torch.ones_like(ids, dtype=torch.bool)], dim=-1)
        last = rows.model.base_model(input_ids=ids, cache=rows.cache, use_cache=True).last_hidden_state[:, -outputs:]
        return last, rows.model.get_output_embeddings()(last).float()

    return fed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=4, help="held-out HumanEval prompts")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--draft-length", type=int, default=5)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()

    pair: Pair = load_pair(backend="transformers", cache_ram=0)
    prompts = [encode_prompt(pair.tokenizer, chat_prompt(p), chat=True) for p in load_humaneval("test")[:args.prompts]]
    timers = {"target": ForwardTimer(pair.target.model.base_model),
              "draft": ForwardTimer(pair.draft.model.base_model)}
    greedy, ours_feed = Sampling(0.0), TransformersRows.feed

    def ours(prompt: list[int], feed: Callable) -> list[int]:
        TransformersRows.feed = feed
        try:
            return decode(pair.target, [prompt], draft=pair.draft, verification=Verification("exact"), sampling=greedy,
                          draft_length=args.draft_length, max_new_tokens=args.max_new_tokens,
                          eos_token_ids=pair.eos_token_ids).tokens[0]
        finally:
            TransformersRows.feed = ours_feed

    variants = {"ours": lambda p: ours(p, ours_feed), "plain": lambda p: ours(p, plain_feed(ours_feed)),
                "transformers": lambda p: assisted_generate(pair, p, greedy, draft_length=args.draft_length,
                                                            max_new_tokens=args.max_new_tokens)[0]}
    totals = {name: {"wall": 0.0, "tokens": 0, "target": [0.0, 0], "draft": [0.0, 0]} for name in variants}
    turn = 0
    for _ in range(args.repeats):
        for prompt in prompts:
            for name in list(variants) if turn % 2 == 0 else list(variants)[::-1]:
                before = {role: (t.seconds, t.calls) for role, t in timers.items()}
                start = time.perf_counter()
                tokens = variants[name](prompt)
                total = totals[name]
                total["wall"] += time.perf_counter() - start
                total["tokens"] += len(tokens)
                for role, t in timers.items():
                    total[role][0] += t.seconds - before[role][0]
                    total[role][1] += t.calls - before[role][1]
            turn += 1
    print(f"# greedy, {args.draft_length} drafts, {len(prompts)} HumanEval prompts x {args.repeats}, "
          f"{args.max_new_tokens} new tokens, {torch.get_num_threads()} threads\n")
    print("| loop | tokens | tokens/s | target forwards | ms each | draft forwards | ms each | outside forwards |")
    print("|---|---|---|---|---|---|---|---|")
    for name, t in totals.items():
        (target, targets), (draft, drafts) = t["target"], t["draft"]
        print(f"| {name} | {t['tokens']} | {t['tokens'] / t['wall']:.2f} | {targets} | {1e3 * target / targets:.0f} "
              f"| {drafts} | {1e3 * draft / drafts:.1f} | {(t['wall'] - target - draft) / t['wall']:.1%} |")


if __name__ == "__main__":
    main()

"""Which transformers dtype is cheapest for the target on this CPU: one target step and verify passes over
k tokens for each --dtype, taking turns in one run (medians), with the draft's step beside them.

    .venv/bin/python benchmarks/dtype_costs.py --dtypes float32 float16 bfloat16 --widths 1 2 4 8 16 \
        --out benchmarks/results/dtype-costs.json

Each dtype loads the default pair as `load_pair(backend="transformers", dtype=...)` does (the draft in dynamic
int8, its default; `--no-draft-int8` gives the draft the target's dtype), after a HumanEval prompt repeated to
--context tokens, as decoding sees it midway through an answer.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from machine import describe
from speed import forward_costs

from diversed.models.loading import load_pair
from diversed.tasks import get_task
from diversed.text import encode_prompt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "float16", "bfloat16"])
    parser.add_argument("--widths", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--draft-int8", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    pairs = {dtype: load_pair(backend="transformers", dtype=dtype, draft_int8=args.draft_int8) for dtype in args.dtypes}
    prompt = encode_prompt(next(iter(pairs.values())).tokenizer,
                           get_task("humaneval").examples("test", limit=1)[0].prompt)
    draft_lens = [k - 1 for k in args.widths if k > 1]
    medians: dict[str, dict[str, float]] = {dtype: {} for dtype in pairs}
    for _ in range(args.repeats):  # the dtypes take turns, so that a slow spell hits all of them alike
        for dtype, pair in pairs.items():
            times = forward_costs(pair, prompt, draft_lens, repeats=1, context=args.context)
            for name, values in times.items():
                medians[dtype].setdefault(name, []).extend(values)
    medians = {d: {k: 1000 * statistics.median(v) for k, v in times.items()} for d, times in medians.items()}
    machine = describe()
    columns = ["target_step", *(f"verify_{k}" for k in args.widths if k > 1), "draft_step"]
    print(f"\n{machine}; {args.context} tokens in the cache, medians of {args.repeats} (ms)\n")
    print("| target dtype | " + " | ".join(["1 token", *(f"{k} tokens" for k in args.widths if k > 1),
                                           "draft step"]) + " |")
    print("|---" * (len(columns) + 1) + "|")
    for dtype, row in medians.items():
        print(f"| {dtype} | " + " | ".join(f"{row[c]:.0f}" for c in columns) + " |")
    if args.out:
        args.out.write_text(json.dumps({"machine": machine, "context": args.context, "draft_int8": args.draft_int8,
                                        "ms": medians}, indent=1) + "\n")


if __name__ == "__main__":
    main()

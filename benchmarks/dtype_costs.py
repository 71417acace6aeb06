"""Which transformers dtype is cheapest for the target on this CPU: one target step and verify passes over
k tokens for each --dtype, taking turns in one run (medians), with the draft's step beside them.

    .venv/bin/python benchmarks/dtype_costs.py --dtypes float32 float16 bfloat16 --widths 1 2 4 8 16 \
        --out benchmarks/results/dtype-costs.json

Each dtype loads the default pair as `load_pair(backend="transformers", dtype=...)` does (the draft in dynamic
int8, its default; `--no-draft-int8` gives the draft the target's dtype), after a HumanEval prompt repeated to
--context tokens, as decoding sees it midway through an answer.

`--int8` then times the draft's step in the two int8 forms, taking turns, for 1 and 4 rows: per-token
activation scales (Int8Linear, the default, which keeps a row's result independent of the batch) against
torch.ao's dynamic int8 layer (one scale over the whole call, the default before).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from speed import forward_costs
from transformers import AutoTokenizer

from diversed.machine import describe
from diversed.models.default_pair import prepare_default_pair
from diversed.models.loading import load_pair
from diversed.tasks import get_task
from diversed.text import encode_prompt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", nargs="*", default=["float32", "float16", "bfloat16"])
    parser.add_argument("--widths", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--draft-int8", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--int8", action="store_true", help="also compare the two int8 forms of the draft")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    pairs = {dtype: load_pair(backend="transformers", dtype=dtype, draft_int8=args.draft_int8,
                               cache_ram=0) for dtype in args.dtypes}
    tokenizer = AutoTokenizer.from_pretrained(prepare_default_pair(progress=False)[1])
    prompt = encode_prompt(tokenizer, get_task("humaneval").examples("test", limit=1)[0].prompt)
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
    if pairs:
        print("| target dtype | " + " | ".join(["1 token", *(f"{k} tokens" for k in args.widths if k > 1),
                                               "draft step"]) + " |")
        print("|---" * (len(columns) + 1) + "|")
    for dtype, row in medians.items():
        print(f"| {dtype} | " + " | ".join(f"{row[c]:.0f}" for c in columns) + " |")
    report = {"machine": machine, "context": args.context, "draft_int8": args.draft_int8, "ms": medians}
    if args.int8:
        report["int8_draft_step_ms"] = int8_forms(prompt, args.context, args.repeats)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")


def int8_forms(prompt: list[int], context: int, repeats: int) -> dict[str, dict[int, float]]:
    """Median draft step (ms) of the default draft in each int8 form, for 1 and 4 rows, taking turns."""
    import warnings

    from torch import nn
    from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear

    from diversed.backends import as_model
    from diversed.models.default_pair import prepare_default_pair
    from diversed.models.loading import load_model
    from diversed.models.quantize import quantize_linears

    def torch_ao(model: nn.Module) -> nn.Module:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for parent in list(model.modules()):
                for name, child in list(parent.named_children()):
                    if type(child) is nn.Linear:
                        child.qconfig = torch.ao.quantization.per_channel_dynamic_qconfig
                        setattr(parent, name, DynamicLinear.from_float(child))
        return model

    folder = str(prepare_default_pair(progress=False)[0])
    forms = {"per token (Int8Linear)": as_model(quantize_linears(load_model(folder, dtype="float32",
                                                                              onednn=False)[1], "int8")),
             "per call (torch.ao)": as_model(torch_ao(load_model(folder, dtype="float32", onednn=False)[1]))}
    cached = (prompt * (context // len(prompt) + 1))[:context]
    times: dict[str, dict[int, list[float]]] = {name: {1: [], 4: []} for name in forms}
    states = {(name, rows): model.rows(rows) for name, model in forms.items() for rows in (1, 4)}
    for (_, rows), state in states.items():
        state.feed([cached] * rows, 1)
    for _ in range(repeats * 2):
        for (name, rows), state in states.items():
            start = time.perf_counter()
            state.feed([prompt[-1:]] * rows, 1)
            times[name][rows].append(time.perf_counter() - start)
            state.truncate([context] * rows)
    result = {name: {rows: 1000 * statistics.median(v) for rows, v in by_rows.items()}
              for name, by_rows in times.items()}
    print("\n| int8 draft | step, 1 row (ms) | step, 4 rows (ms) |\n|---|---|---|")
    for name, by_rows in result.items():
        print(f"| {name} | {by_rows[1]:.1f} | {by_rows[4]:.1f} |")
    return result


if __name__ == "__main__":
    main()

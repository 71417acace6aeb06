"""How close the default draft stays to float32 at each precision the transformers backend offers a CPU draft,
and what its step costs, with each set of FBGEMM kernels an x86 CPU can get: this CPU's own, and the AVX2
kernels forced (FBGEMM_ENABLE_INSTRUCTIONS=AVX2, what an AVX2-only CPU runs; on a CPU with AVX-512 a stand-in
for the kernels' arithmetic, not for that CPU's speed).

Per kernel set, one child process: the default draft (Qwen2.5-Coder-0.5B-Instruct, float32 safetensors) in
float32 (the reference, plain nn.Linear), in float16 weights and in int8 (diversed.models.quantize); where
the float16 kernels pad calls to keep rows batch-invariant, also unpadded, to price that. Closeness: the
total variation distance between each precision's next-token distribution and float32's, and whether their
argmax agrees, at the --positions answer positions of each of --chats chats (the README's first prompt, then
GSM8K and HumanEval test problems in turn, through the chat template, each followed by float32's greedy
answer): mean, max and top-1 agreement over all positions. Cost: a draft step over 1 and 4 rows with
--context tokens cached, the precisions taking turns, medians of --repeats.

The rule for the default draft precision on a CPU, fixed before the first run: int8 where, with that CPU's
kernels, the int8 draft's mean TV to float32 is at most 0.03 and its 1-row step costs at most 0.9x the
float16-weight draft's; else float16 weights.

    .venv/bin/python benchmarks/draft_precision.py --out benchmarks/results/draft-precision-MACHINE.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch

from diversed.backends import as_model
from diversed.machine import describe
from diversed.models.default_pair import prepare_default_pair
from diversed.models.loading import load_model
from diversed.models.quantize import Float16Linear, exact_int8_sums, float16_rows_agree
from diversed.tasks import get_task
from diversed.text import encode_prompt

PRECISIONS = {"float16 weights": {"dtype": "float16"}, "int8": {"dtype": "float16", "int8": True}}
MAX_TV, MAX_COST = 0.03, 0.9  # the rule above
FIRST_CHAT = "Write a Python function that reverses a string."


def chats(count: int) -> list[str]:
    """The README's first prompt, then GSM8K and HumanEval test problems in turn: prose, arithmetic, code."""
    tasks = [get_task(name).examples("test", limit=count) for name in ("gsm8k", "humaneval")]
    return [FIRST_CHAT, *(tasks[i % 2][i // 2].prompt for i in range(count - 1))]


def measure(count: int, positions: int, context: int, repeats: int) -> dict:
    """This process's kernels: each precision's closeness to float32 and its step costs."""
    folder = str(prepare_default_pair(progress=False)[0])
    tokenizer, reference = load_model(folder, dtype="float32", onednn=False)
    models = {name: load_model(folder, **options)[1] for name, options in PRECISIONS.items()}
    if not float16_rows_agree():
        models["float16 weights, unpadded"] = load_model(folder, **PRECISIONS["float16 weights"])[1]
        for layer in models["float16 weights, unpadded"].modules():
            if isinstance(layer, Float16Linear):
                layer.pad = False
    texts = []
    with torch.no_grad():
        for chat in chats(count):
            prompt = torch.tensor([encode_prompt(tokenizer, chat)])
            answer = reference.generate(prompt, max_new_tokens=positions, min_new_tokens=positions, do_sample=False)
            texts.append(answer)
        target = [reference(t).logits[0, -positions - 1:-1].softmax(-1) for t in texts]
        closeness = {}
        for name, model in models.items():
            p = [model(t).logits[0, -positions - 1:-1].softmax(-1) for t in texts]
            tv = torch.cat([0.5 * (a - b).abs().sum(-1) for a, b in zip(p, target, strict=True)])
            top1 = torch.cat([a.argmax(-1) == b.argmax(-1) for a, b in zip(p, target, strict=True)])
            closeness[name] = {"tv_mean": float(tv.mean()), "tv_max": float(tv.max()),
                               "top1": float(top1.float().mean()), "positions": len(tv)}
    return {"machine": describe(), "kernels": os.environ.get("FBGEMM_ENABLE_INSTRUCTIONS", "native"),
            "exact_int8_sums": exact_int8_sums(), "float16_rows_agree": float16_rows_agree(),
            "closeness": closeness, "step_ms": step_costs(models, texts[0][0].tolist(), context, repeats)}


def step_costs(models: dict, prompt: list[int], context: int, repeats: int) -> dict[str, dict[str, float]]:
    """Median draft step (ms) per precision, over "1" and "4" rows, `context` tokens cached, taking turns."""
    cached = (prompt * (context // len(prompt) + 1))[:context]
    states = {(name, rows): as_model(model).rows(rows) for name, model in models.items() for rows in (1, 4)}
    for (_, rows), state in states.items():
        state.feed([cached] * rows, 1)
    times: dict[tuple, list[float]] = {key: [] for key in states}
    for repeat in range(repeats + 1):
        for key, state in states.items():
            start = time.perf_counter()
            state.feed([prompt[-1:]] * key[1], 1)
            if repeat:  # the first is a warm-up
                times[key].append(time.perf_counter() - start)
            state.truncate([context] * key[1])
    result: dict[str, dict[str, float]] = {}
    for (name, rows), values in times.items():
        result.setdefault(name, {})[str(rows)] = 1000 * statistics.median(values)
    return result


def default_precision(run: dict) -> str:
    """The rule in the module docstring."""
    int8, steps = run["closeness"]["int8"], run["step_ms"]
    cheaper = steps["int8"]["1"] <= MAX_COST * steps["float16 weights"]["1"]
    return "int8" if int8["tv_mean"] <= MAX_TV and cheaper else "float16 weights"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kernels", nargs="+", default=["native", "AVX2"],
                        help="FBGEMM kernel sets: native (this CPU's), or a FBGEMM_ENABLE_INSTRUCTIONS value")
    parser.add_argument("--chats", type=int, default=4)
    parser.add_argument("--positions", type=int, default=50)
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.child:
        warnings.simplefilter("ignore")
        print(json.dumps(measure(args.chats, args.positions, args.context, args.repeats)))
        return
    runs = []
    for kernels in args.kernels:
        env = {k: v for k, v in os.environ.items() if k != "FBGEMM_ENABLE_INSTRUCTIONS"}
        if kernels != "native":
            env["FBGEMM_ENABLE_INSTRUCTIONS"] = kernels
        child = subprocess.run([sys.executable, __file__, "--child", "--chats", str(args.chats), "--positions",
                                str(args.positions), "--context", str(args.context), "--repeats", str(args.repeats)],
                               env=env, stdout=subprocess.PIPE, text=True, check=True)  # its errors show
        runs.append(json.loads(child.stdout.strip().splitlines()[-1]))
    print(f"\n{runs[0]['machine']}; the default draft, {args.chats} chats x {args.positions} answer positions; "
          f"steps with {args.context} tokens cached, medians of {args.repeats}\n")
    print("| FBGEMM kernels | int8 sums exact | float16 rows alike | draft precision | TV to float32, mean | max "
          "| top-1 agreement | step, 1 row (ms) | 4 rows (ms) |\n|---|---|---|---|---|---|---|---|---|")
    for run in runs:
        for name, close in run["closeness"].items():
            steps = run["step_ms"][name]
            print(f"| {run['kernels']} | {'yes' if run['exact_int8_sums'] else 'no'} | "
                  f"{'yes' if run['float16_rows_agree'] else 'no'} | {name} | {close['tv_mean']:.4f} | "
                  f"{close['tv_max']:.3f} | {close['top1']:.0%} | {steps['1']:.1f} | {steps['4']:.1f} |")
    print()
    for run in runs:
        run["default_precision"] = default_precision(run)
        print(f"{run['kernels']}: by the rule, the draft's default precision is {run['default_precision']}")
    if args.out:
        args.out.write_text(json.dumps({"runs": runs}, indent=1) + "\n")


if __name__ == "__main__":
    main()

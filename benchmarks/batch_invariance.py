"""Does a request's result depend on its company? The same requests decoded alone, together in one batch
and after other traffic, on the default pair, counting the requests whose tokens or draft counts differ.

- transformers (--backend transformers): the six-request mix of issue 49 (two chat prompts, each under
  exact, static:0.5 and lossy:0.3), T = 0 and a seeded T = 1, 3 drafts a round from the draft model at its
  default precision (int8 per token): every request should read the same in all three runs.
- llama.cpp (--backend llama.cpp): --prompts held-out prompts (HumanEval then GSM8K test problems) at T = 0,
  the target alone and exact with 3 drafts, alone and in batches of --batch: llama.cpp's logits depend on
  the batch's shape, so greedy answers may part at near-ties; this counts how often.
- --costs (transformers): what row-by-row attention (diversed.backends.hf, which makes the first check pass
  on a CPU) costs against batched SDPA: the target's pass over 1 and 6 tokens for 1 and 6 rows of unequal
  lengths, the two taking turns (medians); and where FBGEMM's float16 kernels need padding to keep rows
  batch-invariant (its AVX2 kernels: FBGEMM_ENABLE_INSTRUCTIONS=AVX2 forces them on any x86 CPU), what the
  padding costs: the target's pass over 1, 2 and 7 tokens of one row, padded and not, taking turns.

    .venv/bin/python benchmarks/batch_invariance.py --backend transformers --costs \
        --out results/batch-invariance-hf.json
    .venv/bin/python benchmarks/batch_invariance.py --backend llama.cpp --prompts 52 --tokens 48 \
        --out results/batch-invariance-llama.json
    FBGEMM_ENABLE_INSTRUCTIONS=AVX2 .venv/bin/python benchmarks/batch_invariance.py --backend transformers \
        --costs --out results/batch-invariance-hf-avx2.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from diversed.backends.hf import ROW_ATTENTION
from diversed.decoding.drafters import make_drafter
from diversed.decoding.engine import Batch, Job
from diversed.decoding.policy import Policy
from diversed.machine import describe
from diversed.models.loading import Pair, load_pair
from diversed.models.quantize import Float16Linear
from diversed.request import Drafting, Sampling, Verification
from diversed.tasks import get_task
from diversed.text import encode_prompt

MIX_PROMPTS = ("Name three prime numbers greater than 50.", "Write a Python function that reverses a string.")
MIX_RULES = ("exact", "static:0.5", "lossy:0.3")


def run(pair: Pair, requests: list[tuple[list[int], Verification]], temperature: float, tokens: int, together: int,
        traffic: list[list[int]] = ()) -> list[tuple]:
    """Each request's (tokens, drafted, accepted), decoded `together` at a time (in order), after `traffic`
    (prompts decoded to the end first, on the same batch)."""
    capacity = max(together, len(traffic), 1)
    batch = Batch(pair.target, make_drafter("model", pair.draft, capacity=capacity), drafting=Drafting(3),
                  eos_token_ids=pair.eos_token_ids, capacity=capacity)

    def job(ids: list[int], verification: Verification, seed: int) -> Job:
        return Job(list(ids), Policy(verification, Sampling(temperature), torch.Generator().manual_seed(seed)), tokens)

    for i, ids in enumerate(traffic):
        batch.add(job(ids, Verification.parse("static:0.2"), 1000 + i))
    while batch.jobs:
        batch.step()
    results = []
    for start in range(0, len(requests), together):
        jobs = [job(ids, verification, start + i)
                for i, (ids, verification) in enumerate(requests[start:start + together])]
        for j in jobs:
            batch.add(j)
        while batch.jobs:
            batch.step()
        results += [(j.tokens, j.stats.drafted, j.stats.accepted) for j in jobs]
    return results


def compare(name: str, solo: list[tuple], other: list[tuple], labels: list[str]) -> dict:
    differ = [label for label, a, b in zip(labels, solo, other, strict=True) if a != b]
    tokens = [label for label, a, b in zip(labels, solo, other, strict=True) if a[0] != b[0]]
    print(f"{name}: {len(differ)} of {len(labels)} requests differ from alone ({len(tokens)} in their tokens)"
          + (f": {', '.join(differ)}" if differ else ""), flush=True)
    return {"run": name, "requests": len(labels), "differ": len(differ), "tokens_differ": len(tokens),
            "which": differ}


@torch.inference_mode()
def attention_costs(pair: Pair, prompt: list[int], context: int, repeats: int) -> dict[str, float]:
    """Median ms of the target's pass over `width` tokens for `count` rows (their caches `context` tokens
    and 7 fewer per row after the first, so that shorter rows hold holes), per attention implementation."""
    model = pair.target.model
    cached = (prompt * (context // len(prompt) + 1))[:context]
    times: dict[str, list[float]] = {}
    for _ in range(repeats + 1):  # the first round warms up
        for attention in (ROW_ATTENTION, "sdpa"):
            model.set_attn_implementation(attention)
            for count in (1, 6):
                rows = pair.target.rows(count)
                rows.feed([cached[7 * i:] for i in range(count)], 1)
                held = rows.lengths
                for width in (1, 6):
                    start = time.perf_counter()
                    rows.feed([prompt[:width]] * count, width)
                    times.setdefault(f"{attention}, {count} rows, {width} tokens", []).append(
                        time.perf_counter() - start)
                    rows.truncate(held)
    model.set_attn_implementation(ROW_ATTENTION)
    return {name: 1000 * statistics.median(t[1:]) for name, t in times.items()}


@torch.inference_mode()
def padding_costs(pair: Pair, prompt: list[int], context: int, repeats: int) -> dict[str, float]:
    """Median ms of the target's pass over 1, 2 and 7 tokens of one row (`context` cached), with its float16
    layers padding their calls (Float16Linear.pad) and not, taking turns; nothing where they need no padding."""
    layers = [m for m in pair.target.model.modules() if isinstance(m, Float16Linear)]
    if not any(layer.pad for layer in layers):
        return {}
    cached = (prompt * (context // len(prompt) + 1))[:context]
    rows = pair.target.rows(1)
    rows.feed([cached], 1)
    times: dict[str, list[float]] = {}
    for _ in range(repeats + 1):  # the first round warms up
        for pad in (True, False):
            for layer in layers:
                layer.pad = pad
            for width in (1, 2, 7):
                start = time.perf_counter()
                rows.feed([prompt[:width]], width)
                times.setdefault(f"{'padded' if pad else 'not padded'}, {width} tokens", []).append(
                    time.perf_counter() - start)
                rows.truncate([context])
    for layer in layers:
        layer.pad = True
    return {name: 1000 * statistics.median(t[1:]) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=("transformers", "llama.cpp"), required=True)
    parser.add_argument("--prompts", type=int, default=52, help="llama.cpp: held-out prompts")
    parser.add_argument("--batch", type=int, default=4, help="llama.cpp: rows decoded together")
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--costs", action="store_true", help="transformers: time row-by-row attention too")
    parser.add_argument("--batched-attention", action="store_true",
                        help="transformers: the control, batched SDPA over the cache holes instead of row by row")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    pair = load_pair(backend=args.backend, cache_ram=0)
    if args.batched_attention:
        for model in (pair.draft.model, pair.target.model):
            model.set_attn_implementation("sdpa")
    report = {"machine": describe(), "backend": args.backend, "tokens": args.tokens, "results": []}
    print(report["machine"], flush=True)
    if args.backend == "transformers":
        requests = [(encode_prompt(pair.tokenizer, p), Verification.parse(r)) for p in MIX_PROMPTS for r in MIX_RULES]
        labels = [f"{r} on prompt {i + 1}" for i in range(len(MIX_PROMPTS)) for r in MIX_RULES]
        traffic = [encode_prompt(pair.tokenizer, "Count from 1 to 20."), encode_prompt(pair.tokenizer, "Hi!")]
        for temperature in (0.0, 1.0):
            solo = run(pair, requests, temperature, args.tokens, 1)
            for name, together, before in (("together", len(requests), ()), ("after traffic", len(requests),
                                                                               traffic)):
                report["results"].append({"temperature": temperature, **compare(
                    f"T = {temperature}, {name}", solo, run(pair, requests, temperature, args.tokens, together,
                                                            before), labels)})
        if args.costs:
            costs = report["attention_ms"] = attention_costs(pair, requests[3][0], 220, 5)
            print("\n| attention, rows, tokens | ms |\n|---|---|")
            for name, ms in costs.items():
                print(f"| {name} | {ms:.1f} |")
            padding = report["padding_ms"] = padding_costs(pair, requests[3][0], 220, 5)
            print("\n| float16 layers, target pass of one row | ms |\n|---|---|" if padding else
                  "\nFBGEMM's float16 kernels here need no padding.")
            for name, ms in padding.items():
                print(f"| {name} | {ms:.1f} |")
    else:
        half = args.prompts // 2
        texts = ([e.prompt for e in get_task("humaneval").examples("test", limit=args.prompts - half)]
                 + [e.prompt for e in get_task("gsm8k").examples("test", limit=half)])
        ids = [encode_prompt(pair.tokenizer, t) for t in texts]
        labels = [f"prompt {i + 1}" for i in range(len(ids))]
        for rule in ("plain", "exact"):
            requests = [(i, Verification.parse(rule)) for i in ids]
            solo = run(pair, requests, 0.0, args.tokens, 1)
            report["results"].append({"rule": rule, **compare(f"{rule}, batches of {args.batch}", solo, run(
                pair, requests, 0.0, args.tokens, args.batch), labels)})
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()

"""Does llama.cpp's flash-attention setting, or the size of the KV buffer, keep a long answer's last tokens as
fast as its first? The target of the default pair alone, through diversed's llama.cpp backend (one row, fed
one greedy token at a time, as a server's lone request is decoded), a 60-token prompt and 1,024 new tokens:
the time of the last 100 against the first 100, each setting in its own context, interleaved (the order
reversing every repeat). `--vary flash`: flash attention auto (llama.cpp's default), on and off; `--vary
context`: the backend's KV buffer (4 rows of 4,096 positions) against 4 rows of 2,048 and of 1,152 (just
room for this answer).

    .venv/bin/python benchmarks/long_answer_attention.py --repeats 3 > benchmarks/results/long-answer-attention.log
    .venv/bin/python benchmarks/long_answer_attention.py --vary context --repeats 3 \
        > benchmarks/results/long-answer-context.log
"""

from __future__ import annotations

import argparse
import time

import llama_cpp as llama
from machine import describe

from diversed.backends import llama_cpp as backend
from diversed.models.default_pair import default_gguf_pair

SETTINGS = {"auto": llama.LLAMA_FLASH_ATTN_TYPE_AUTO, "on": llama.LLAMA_FLASH_ATTN_TYPE_ENABLED,
            "off": llama.LLAMA_FLASH_ATTN_TYPE_DISABLED}


def load(path, setting: int, context: int = backend.DEFAULT_CONTEXT) -> backend.LlamaCppModel:
    """A model whose context is made with this flash-attention setting and `context` positions a row (the
    backend takes llama.cpp's default context parameters; they are read when the context is made, at the
    first rows())."""
    default = llama.llama_context_default_params

    def params():
        p = default()
        p.flash_attn_type = setting
        return p

    backend.llama.llama_context_default_params = params
    try:
        model = backend.LlamaCppModel(path, name=f"flash attention {setting}", context=context)
        model.rows(1)
    finally:
        backend.llama.llama_context_default_params = default
    return model


def step_times(model: backend.LlamaCppModel, prompt: list[int], tokens: int) -> list[float]:
    rows = model.rows(1)
    _, logits = rows.feed([prompt], 1)
    times = []
    for _ in range(tokens):
        token = int(logits[0, -1].argmax())
        start = time.perf_counter()
        _, logits = rows.feed([[token]], 1)
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--vary", choices=("flash", "context"), default="flash")
    args = parser.parse_args()
    print(describe())
    _, target = default_gguf_pair()
    if args.vary == "flash":
        models = {f"flash attention {name}": load(target, setting) for name, setting in SETTINGS.items()}
    else:
        models = {f"{size} positions a row": load(target, SETTINGS["auto"], size) for size in (4096, 2048, 1152)}
    prompt = list(range(1000, 1060))  # any 60 tokens: the answer's cost does not depend on its text
    totals = {name: [0.0, 0.0] for name in models}
    for repeat in range(args.repeats):
        for name in list(models) if repeat % 2 == 0 else reversed(list(models)):
            times = step_times(models[name], prompt, args.tokens)
            first, last = sum(times[:100]), sum(times[-100:])
            totals[name][0] += first
            totals[name][1] += last
            print(f"repeat {repeat}, {name}: first 100 {first:.2f} s, last 100 {last:.2f} s, "
                  f"last/first {last / first:.3f}", flush=True)
    print("| setting | first 100 tokens (s) | last 100 (s) | last/first |\n|---|---|---|---|")
    for name, (first, last) in totals.items():
        print(f"| {name} | {first / args.repeats:.2f} | {last / args.repeats:.2f} | {last / first:.3f} |")


if __name__ == "__main__":
    main()

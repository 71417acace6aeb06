"""Does llama.cpp's flash-attention setting, the size of the KV buffer, or diversed's own code keep a long
answer's last tokens from coming as fast as its first? The target of the default pair alone, through
diversed's llama.cpp backend (one row, fed one greedy token at a time, as a server's lone request is
decoded), a 60-token prompt and 1,024 new tokens: the time of the last 100 against the first 100, each
setting in its own context, interleaved (the order reversing every repeat). `--vary flash`: flash attention
auto (llama.cpp's default), on and off; `--vary context`: the backend's KV buffer (4 rows of 4,096
positions) against 4 rows of 2,048 and of 1,152 (just room for this answer); `--vary engine`: a bare
llama_decode loop on a context like llama-server's (4 slots, 4,096 positions in one buffer), the backend,
and the decoding loop (a Batch with the target alone, as the server runs it).

    .venv/bin/python benchmarks/long_answer_attention.py --repeats 3 > benchmarks/results/long-answer-attention.log
    .venv/bin/python benchmarks/long_answer_attention.py --vary context --repeats 3 \
        > benchmarks/results/long-answer-context.log
    .venv/bin/python benchmarks/long_answer_attention.py --vary engine --repeats 3 \
        > benchmarks/results/long-answer-engine.log
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import llama_cpp as llama
import numpy as np

from diversed.backends import llama_cpp as backend
from diversed.decoding.engine import Batch, Job
from diversed.decoding.policy import Policy
from diversed.machine import describe
from diversed.models.default_pair import default_gguf_pair
from diversed.request import Verification

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


def bare_llama_cpp(path, prompt: list[int], tokens: int) -> Callable[[], list[float]]:
    """Step times of llama.cpp alone: a llama_decode per greedy token (the argmax read from its logits), on a
    context like llama-server's defaults with 4 slots (4,096 positions in one KV buffer, 2,048-token batches)."""
    model = llama.llama_model_load_from_file(str(path).encode(), llama.llama_model_default_params())
    vocab = llama.llama_vocab_n_tokens(llama.llama_model_get_vocab(model))
    params = llama.llama_context_default_params()
    params.n_ctx, params.n_seq_max, params.n_batch, params.kv_unified = 4096, 4, 2048, True
    params.n_threads = params.n_threads_batch = backend.default_threads()
    context = llama.llama_init_from_model(model, params)

    def decode(batch, start: int, new: list[int]) -> int:
        for i, token in enumerate(new):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, start + i, 1, i == len(new) - 1
            batch.seq_id[i][0] = 0
        batch.n_tokens = len(new)
        llama.llama_decode(context, batch)
        return int(np.ctypeslib.as_array(llama.llama_get_logits_ith(context, -1), shape=(vocab,)).argmax())

    def run() -> list[float]:
        llama.llama_memory_clear(llama.llama_get_memory(context), True)
        batch = llama.llama_batch_init(len(prompt), 0, 1)
        token, times = decode(batch, 0, prompt), []
        for k in range(tokens):
            start = time.perf_counter()
            token = decode(batch, len(prompt) + k, [token])
            times.append(time.perf_counter() - start)
        llama.llama_batch_free(batch)
        return times

    return run


def decoding_loop(model: backend.LlamaCppModel, prompt: list[int], tokens: int) -> list[float]:
    """Round times of the decoding loop, a Batch of 4 rows' room with one job decoded by the target alone."""
    batch = Batch(model, capacity=4)
    job = Job(prompt=list(prompt), policy=Policy(Verification("plain")), max_new_tokens=tokens + 1)
    batch.add(job)
    batch.step()  # the prompt and the first token
    times = []
    while not job.finished:
        start = time.perf_counter()
        batch.step()
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--vary", choices=("flash", "context", "engine"), default="flash")
    args = parser.parse_args()
    print(describe())
    _, target = default_gguf_pair()
    prompt = list(range(1000, 1060))  # any 60 tokens: the answer's cost does not depend on its text

    def fed(model: backend.LlamaCppModel) -> Callable[[], list[float]]:
        return lambda: step_times(model, prompt, args.tokens)

    if args.vary == "flash":
        runs = {f"flash attention {name}": fed(load(target, setting)) for name, setting in SETTINGS.items()}
    elif args.vary == "context":
        runs = {f"{size} positions a row": fed(load(target, SETTINGS["auto"], size)) for size in (4096, 2048, 1152)}
    else:
        ours = load(target, SETTINGS["auto"])
        runs = {"llama.cpp alone (llama_decode)": bare_llama_cpp(target, prompt, args.tokens),
                "diversed's backend": fed(ours),
                "diversed's decoding loop": lambda: decoding_loop(ours, prompt, args.tokens)}
    totals = {name: [0.0, 0.0] for name in runs}
    for repeat in range(args.repeats):
        for name in list(runs) if repeat % 2 == 0 else reversed(list(runs)):
            times = runs[name]()
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

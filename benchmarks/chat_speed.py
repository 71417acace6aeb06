"""Conversations that resend their history: `diversed serve` against `llama-server`, each with its prompt cache
as shipped (on by default in both), on the default pair's target GGUF, T = 0, streaming.

Each conversation shows a real source file (the first 200 lines of a standard-library module, about 2,000
tokens) with a first question, then asks four short follow-ups, each turn resending the whole conversation
with the earlier answers, as chat front ends and coding agents do. Reported per server and client count: the
time to the first token of turn 1 and of turns 2-5 (median and range over conversations), and the total wall
time. With `--clients 4` four conversations run at once (llama-server with `-np 4`, ours with `--max-batch 4`,
the same context per conversation). `--cold` also sends every follow-up again with `cache_prompt: false`
(both servers honour it) and counts the answers that differ from the cached turn's: how often a cached prompt
changes what a server writes at T = 0. `--lines` and `--turns` shorten the conversations, so that `--cold`,
whose every cold turn reads a whole prompt, can afford many of them; beyond 20 conversations each module shows
its next lines.

  .venv/bin/python benchmarks/chat_speed.py --llama-server PATH/llama-server --out results/chat-speed.json
  .venv/bin/python benchmarks/chat_speed.py --llama-server PATH/llama-server --clients 1 --conversations 50 \
      --lines 20 --turns 3 --cold --out results/chat-speed-cold.json
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import statistics
import sys
import time
from pathlib import Path

import openai
from serve_speed import free_port, in_clients, start

from diversed.backends.llama_cpp import DEFAULT_CONTEXT, default_threads
from diversed.machine import describe
from diversed.models.default_pair import default_gguf_pair

# Standard-library modules whose first 200 lines are 1,500-2,300 tokens: each conversation shows one.
MODULES = ("textwrap", "difflib", "tokenize", "heapq", "base64", "functools", "zipfile", "dataclasses", "shlex",
           "calendar", "glob", "string", "shutil", "configparser", "gettext", "pprint", "fractions", "queue",
           "statistics", "random")
QUESTIONS = ("What does this file do? Answer in one sentence.", "Which function in it is the longest?",
             "Name one input that could make it fail.", "How would you test that function?",
             "Summarize the file in five words.")


def sources(count: int, lines: int) -> list[str]:
    """`count` distinct files to show: `lines` lines of each module in turn, then the next `lines` of each."""
    texts = []
    for i in range(count):
        module, window = MODULES[i % len(MODULES)], i // len(MODULES)
        texts.append("".join(inspect.getsource(__import__(module)).splitlines(keepends=True)
                             [window * lines:(window + 1) * lines]))
    return texts


def turn(api: openai.OpenAI, model: str, messages: list[dict], tokens: int, extra: dict) -> dict:
    """One streamed chat turn: its answer, time to the first token, latency and cached prompt tokens."""
    started = time.perf_counter()
    first, pieces, usage = None, [], None
    stream = api.chat.completions.create(model=model, messages=messages, max_tokens=tokens, temperature=0,
                                         stream=True, stream_options={"include_usage": True}, extra_body=extra)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter()
            pieces.append(chunk.choices[0].delta.content)
        if chunk.usage:
            usage = chunk.usage
    details = getattr(usage, "prompt_tokens_details", None)
    return {"text": "".join(pieces), "ttft": (first or time.perf_counter()) - started,
            "latency": time.perf_counter() - started, "prompt_tokens": usage.prompt_tokens if usage else None,
            "cached_tokens": getattr(details, "cached_tokens", None) if details else None}


def conversation(api: openai.OpenAI, model: str, text: str, turns: int, tokens: int, cold: bool) -> list[dict]:
    """The turns of one conversation about a file; with `cold`, each follow-up sent again without the prompt
    cache."""
    messages, results = [], []
    for number, question in enumerate(QUESTIONS[:turns]):
        content = f"Here is a file:\n```python\n{text}```\n{question}" if number == 0 else question
        messages.append({"role": "user", "content": content})
        result = turn(api, model, messages, tokens, {})
        if cold and number:
            result["cold_text"] = turn(api, model, messages, tokens, {"cache_prompt": False})["text"]
        results.append(result)
        messages.append({"role": "assistant", "content": result["text"]})
    return results


def run(port: int, texts: list[str], clients: int, turns: int, tokens: int, cold: bool) -> dict:
    """The conversations through `clients` concurrent clients, each taking the next conversation."""
    api = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=1800)
    model = api.models.list().data[0].id
    done, wall = in_clients(list(enumerate(texts)), clients, lambda item: {
        "conversation": item[0], "turns": conversation(api, model, item[1], turns, tokens, cold)})
    return {"clients": clients, "wall_s": wall, "conversations": done}


def summary(result: dict) -> dict:
    first = [c["turns"][0]["ttft"] for c in result["conversations"]]
    later = [t["ttft"] for c in result["conversations"] for t in c["turns"][1:]] or [math.nan]
    compared = [t for c in result["conversations"] for t in c["turns"][1:] if "cold_text" in t]
    return {"first_ttft_median_s": statistics.median(first), "first_ttft_range_s": [min(first), max(first)],
            "later_ttft_median_s": statistics.median(later), "later_ttft_range_s": [min(later), max(later)],
            "total_s": result["wall_s"],
            "answers_changed_by_cache": (sum(t["cold_text"] != t["text"] for t in compared), len(compared))
            if compared else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama-server", help="path of llama.cpp's llama-server (omit to run ours alone)")
    parser.add_argument("--conversations", type=int, default=2,
                        help="per client count, at least one a client (default 2)")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--lines", type=int, default=200, help="lines of the file the first turn shows")
    parser.add_argument("--turns", type=int, default=len(QUESTIONS), choices=range(1, len(QUESTIONS) + 1))
    parser.add_argument("--tokens", type=int, default=48, help="max_tokens of each turn")
    parser.add_argument("--cold", action="store_true", help="also send each follow-up without the prompt cache")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    _, target = default_gguf_pair()
    threads = str(default_threads())
    report = {"machine": f"{describe()}, {threads} threads", "tokens": args.tokens, "lines": args.lines,
              "turns": args.turns, "results": []}
    for clients in args.clients:
        texts = sources(max(args.conversations, clients), args.lines)
        servers = {"diversed serve": [sys.executable, "-m", "diversed.cli", "serve", "--max-batch", str(clients)]}
        if args.llama_server:  # as users run it: its defaults, one slot a conversation, our context a slot
            servers["llama-server"] = [args.llama_server, "-m", str(target), "-np", str(clients), "-c",
                                       str(clients * DEFAULT_CONTEXT), "-t", threads, "--no-webui"]
        for name, command in servers.items():  # interleaved: each client count runs both servers in turn
            port = free_port()
            libraries = {"LD_LIBRARY_PATH": str(Path(command[0]).parent)} if name.startswith("llama") else None
            process = start([*command, "--port", str(port)], port, libraries)
            try:
                result = {"server": name, **run(port, texts, clients, args.turns, args.tokens, args.cold)}
            finally:
                process.terminate()
                process.wait(60)
            result["summary"] = summary(result)
            report["results"].append(result)
            print(json.dumps({"server": name, "clients": clients, **result["summary"]}), flush=True)
            if args.out:
                args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(table(report["results"]))


def table(results: list[dict]) -> str:
    lines = ["| server | clients | turn 1 TTFT (s) | later turns' TTFT, median (range) (s) | total (s) | "
             "answers changed by the cache |", "|---|---|---|---|---|---|"]
    for r in results:
        s = r["summary"]
        changed = "-" if s["answers_changed_by_cache"] is None else "{} of {}".format(*s["answers_changed_by_cache"])
        lines.append(f"| {r['server']} | {r['clients']} | {s['first_ttft_median_s']:.1f} | "
                     f"{s['later_ttft_median_s']:.2f} ({s['later_ttft_range_s'][0]:.2f}-"
                     f"{s['later_ttft_range_s'][1]:.2f}) | {s['total_s']:.1f} | {changed} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()

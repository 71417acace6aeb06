"""Server throughput and latency: `diversed serve` against llama.cpp's own `llama-server`, on the default pair's
GGUF files, at 1, 4 and 8 concurrent streaming clients (1 = the requests one after another).

Prompt caching is off on both servers (`cache_prompt: false`): each level sends the same prompts, and reusing
their KV would skip the prefill (benchmarks/chat_speed.py measures the caches).
Each server runs alone (one process at a time: on 2 cores a second one would distort every timing), loads,
answers one warm-up request, then takes each level of concurrency in turn; `--rounds` repeats the whole
sequence with the servers in reversed order, so that drift in the machine shows. Every client level sends
the same prompts (held-out HumanEval and GSM8K test problems, chat form) at T = 0 with max_tokens 128.
Reported per server and level: total completion tokens per second over the level's wall time, mean request
latency, mean time to the first token, and (ours) the acceptance rate. `--long N` then streams one N-token
answer per server (a completion that counts on, T = 0) and compares the time of its last 100 tokens with its
first 100: a server whose work per round grew with the answer would show it there.

  .venv/bin/python benchmarks/serve_speed.py --llama-server PATH/llama-server --out results/serve-speed.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import openai
from transformers import AutoTokenizer

from diversed.backends.llama_cpp import default_threads
from diversed.machine import describe
from diversed.models.default_pair import default_gguf_pair, prepare_default_pair
from diversed.tasks import get_task


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(command: list[str], port: int, env: dict | None = None) -> subprocess.Popen:
    """Start a server and wait until it answers /v1/models."""
    log = open(f"/tmp/serve-speed-{port}.log", "w")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    api = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=5)
    deadline = time.monotonic() + 300
    while True:
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{command[0]} did not start; see /tmp/serve-speed-{port}.log")
        try:
            api.models.list()
            return process
        except openai.APIError:
            time.sleep(0.5)


def one_request(api: openai.OpenAI, model: str, prompt: str, extra: dict, tokens: int) -> dict:
    """One streamed chat completion: its completion tokens, latency, time to first token, and our metrics."""
    started = time.perf_counter()
    first, count, usage, speculative = None, 0, None, None
    stream = api.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                         max_tokens=tokens, temperature=0, stream=True,
                                         stream_options={"include_usage": True}, extra_body=extra)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter()
            count += 1
        if chunk.usage:
            usage = chunk.usage.completion_tokens
            speculative = (chunk.model_extra or {}).get("speculative")
    return {"tokens": usage if usage is not None else count, "latency": time.perf_counter() - started,
            "ttft": (first or time.perf_counter()) - started, "speculative": speculative}


def long_answer(port: int, extra: dict, tokens: int, tokenizer) -> dict:
    """One streamed completion of `tokens` tokens (a count that goes on at T = 0): seconds for its first and
    its last 100 tokens, counted by tokenizing the text received by each chunk once the stream has ended (the
    client tokenizing as it reads would take the servers' cores, more the longer the text)."""
    api = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=900)
    model = api.models.list().data[0].id
    pieces, times = [], []
    stream = api.completions.create(model=model, prompt=COUNTING, max_tokens=tokens, temperature=0, stream=True,
                                    extra_body=extra)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            pieces.append(chunk.choices[0].text)
            times.append(time.perf_counter())
    marks = [(t, len(tokenizer("".join(pieces[:i + 1]))["input_ids"])) for i, t in enumerate(times)]

    def at(count: int) -> float:  # when the answer first held `count` tokens
        return next(t for t, n in marks if n >= count)

    written = marks[-1][1]
    first, last = at(100) - marks[0][0], marks[-1][0] - at(written - 100)
    return {"tokens": written, "first_100_s": first, "last_100_s": last, "last_vs_first": last / first}


# A completion prompt whose greedy continuation is long: counting on.
COUNTING = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,"


def in_clients(items: list, clients: int, work: Callable) -> tuple[list, float]:
    """`work(item)` for every item, by `clients` concurrent clients each taking the next item; the results (in
    the order they finished) and the wall time."""
    todo, results, lock = list(items), [], threading.Lock()

    def client() -> None:
        while True:
            with lock:
                if not todo:
                    return
                item = todo.pop(0)
            result = work(item)
            with lock:
                results.append(result)

    started = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results, time.perf_counter() - started


def level(port: int, prompts: list[str], clients: int, extra: dict, tokens: int) -> dict:
    """All prompts through `clients` concurrent clients; totals and means."""
    api = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=600)
    model = api.models.list().data[0].id
    results, wall = in_clients(prompts, clients, lambda prompt: one_request(api, model, prompt, extra, tokens))
    total = sum(r["tokens"] for r in results)
    drafted = sum((r["speculative"] or {}).get("drafted") or 0 for r in results)
    accepted = sum((r["speculative"] or {}).get("accepted") or 0 for r in results)
    return {"clients": clients, "requests": len(results), "tokens": total, "wall_s": wall,
            "tokens_per_s": total / wall, "mean_latency_s": sum(r["latency"] for r in results) / len(results),
            "mean_ttft_s": sum(r["ttft"] for r in results) / len(results),
            "acceptance_rate": accepted / drafted if drafted else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama-server", help="path of llama.cpp's llama-server (omit to run ours alone)")
    parser.add_argument("--humaneval", type=int, default=4)
    parser.add_argument("--gsm8k", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--rules", nargs="+", default=["exact", "plain"],
                        help="verification rules sent to our server, one configuration each")
    parser.add_argument("--spec-n", type=int, default=3, help="llama-server -md's --spec-draft-n-max")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--long", type=int, default=0, metavar="N",
                        help="also stream one N-token answer per server: its last 100 tokens against its first 100")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    draft, target = default_gguf_pair()
    prompts = ([e.prompt for e in get_task("humaneval").examples("test", limit=args.humaneval)] +
               [e.prompt for e in get_task("gsm8k").examples("test", limit=args.gsm8k)])
    batch = str(max(args.clients))
    threads = str(default_threads())
    servers = {"diversed serve": ([sys.executable, "-m", "diversed.cli", "serve", "--max-batch", batch],
                                  [{"verification": rule, "cache_prompt": False} for rule in args.rules])}
    if args.llama_server:
        binary = Path(args.llama_server)
        # One slot per client, each with room for a prompt and 128 tokens; 2 threads like ours.
        common = [str(binary), "-m", str(target), "-np", batch, "-c", str(int(batch) * 1024), "-t", threads,
                  "--no-webui", "--log-disable"]
        # cache_prompt off: every level sends the same prompts, and reusing their KV would skip the prefill.
        fresh = [{"cache_prompt": False}]
        servers["llama-server"] = (common, fresh)
        servers[f"llama-server -md n-max {args.spec_n}"] = (
            [*common, "-md", str(draft), "--spec-draft-n-max", str(args.spec_n)], fresh)
    tokenizer = AutoTokenizer.from_pretrained(prepare_default_pair(progress=False)[1]) if args.long else None
    report = {"machine": f"{describe()}, {threads} threads",
              "tokens": args.tokens, "prompts": len(prompts), "results": []}

    def save(report: dict) -> None:  # after every result: a run cut short keeps what it measured
        if args.out:
            args.out.write_text(json.dumps(report, indent=1) + "\n")

    for round_ in range(args.rounds):
        names = list(servers) if round_ % 2 == 0 else list(reversed(servers))
        for name in names:
            command, variants = servers[name]
            port = free_port()
            libraries = {"LD_LIBRARY_PATH": str(Path(command[0]).parent)} if name.startswith("llama") else None
            process = start([*command, "--port", str(port)], port, libraries)
            try:
                for extra in variants:
                    label = name + (f" ({extra['verification']})" if "verification" in extra else "")
                    level(port, prompts[:1], 1, extra, 16)  # warm-up: first-call costs stay out of the numbers
                    for clients in args.clients:
                        result = {"server": label, "round": round_, **level(port, prompts, clients, extra,
                                                                             args.tokens)}
                        report["results"].append(result)
                        print(json.dumps(result), flush=True)
                        save(report)
                    if args.long:
                        result = {"server": label, "round": round_, **long_answer(port, extra, args.long, tokenizer)}
                        report.setdefault("long", []).append(result)
                        print(json.dumps(result), flush=True)
                        save(report)
            finally:
                process.terminate()
                process.wait(60)
    print(table(report["results"]))
    for r in report.get("long", []):
        print(f"{r['server']}: {r['tokens']}-token answer, first 100 tokens {r['first_100_s']:.2f} s, last 100 "
              f"{r['last_100_s']:.2f} s ({r['last_vs_first']:.2f}x)")


def table(results: list[dict]) -> str:
    lines = ["| server | clients | tokens/s | vs 1 client | mean latency (s) | mean TTFT (s) | acceptance |",
             "|---|---|---|---|---|---|---|"]
    single = {}
    for r in results:
        if r["clients"] == 1:
            single[(r["server"], r["round"])] = r["tokens_per_s"]
    for r in results:
        base = single.get((r["server"], r["round"]))
        rate = "-" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.1%}"
        ratio = f"{r['tokens_per_s'] / base:.2f}x" if base else "-"
        lines.append(f"| {r['server']} | {r['clients']} | {r['tokens_per_s']:.1f} | {ratio} | "
                     f"{r['mean_latency_s']:.1f} | {r['mean_ttft_s']:.2f} | {rate} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()

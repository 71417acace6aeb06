"""Speed on llama.cpp, in one interleaved run on one machine: plain llama.cpp, `diversed` on llama.cpp,
llama.cpp's own speculative decoding, and `diversed` on transformers for the record.

Per temperature and prompt set, one row per configuration: tokens/s (new tokens over the wall time of the
whole generation, prompt processing included, for every engine alike), acceptance, tau and the ratio to
plain llama.cpp. Configurations take turns prompt by prompt, the order reversing every prompt, so that a
slow spell of a shared machine spreads over all of them.

- plain: llama-cpp-python's low-level API, the target alone, one llama_decode per token and llama.cpp's own
  sampler chain (greedy, or temperature then a seeded draw): what a llama-cpp-python user runs, with no
  Python in the timing path that such a user would not have. "no extra buffers" is the same with the model
  loaded with `use_extra_bufts = False` (no repacked weights, no AMX): the workaround for llama.cpp builds
  whose AMX kernels fault on virtualized CPUs, against which setup.sh's build is measured.
- ours: `diversed.decode` on the llama.cpp backend, per --ours (verification@drafting[@quantization]; drafting N,
  speed:N or default; quantization Q3_K_S or Q2_K for the draft requantized by llama.cpp, else its Q4_K_M).
- llama.cpp-spec: `llama-speculative-simple` (built from the llama.cpp source that the llama-cpp-python sdist
  vendors; benchmarks/results/notes/llama-speed.md has the commands) on the same GGUF pair, `--spec-type draft-simple`,
  at each --spec-n; it accepts a draft iff it equals the target's own sampled token, so at T = 1 its
  acceptance is below rejection sampling's. Its time is its reported prompt encoding plus decoding (its
  model loading excluded, as ours is).
- transformers: `diversed` on the transformers backend (float16 target weights, int8 draft).

    .venv/bin/python benchmarks/llama_speed.py --humaneval 6 --gsm8k 4 --tokens 128 \
        --speculative-simple /tmp/llsrc/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin/llama-speculative-simple \
        --out benchmarks/results/llama-speed.json
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import llama_cpp as llama

from diversed.admission import load_head
from diversed.backends.llama_cpp import LlamaCppModel, default_threads
from diversed.decoding.engine import decode
from diversed.decoding.metrics import SequenceStats, summarize
from diversed.decoding.schedule import CostMemory
from diversed.machine import describe
from diversed.models.default_pair import default_gguf_pair
from diversed.models.loading import Pair, load_pair
from diversed.request import DEFAULT_DRAFTING, Drafting, Sampling, Verification
from diversed.tasks import get_task
from diversed.text import encode_prompt

OURS = ("plain@-", "exact@1", "exact@2", "exact@3", "exact@default", "static:0.5@default", "diversed@default",
        "exact@default@Q3_K_S", "diversed@default@Q3_K_S")


@dataclass
class Row:
    """One configuration's totals over the prompts of one (prompt set, temperature)."""

    name: str
    stats: list[SequenceStats] = field(default_factory=list)
    seconds: float = 0.0

    def add(self, stats: SequenceStats, seconds: float) -> None:
        self.stats.append(stats)
        self.seconds += seconds

    @property
    def tokens_per_s(self) -> float:
        return sum(s.new_tokens for s in self.stats) / self.seconds


def plain_llama(model: LlamaCppModel, prompt: list[int], tokens: int, temperature: float, seed: int,
                eos: set[int]) -> tuple[SequenceStats, float]:
    """The target alone through llama-cpp-python's low-level API and llama.cpp's sampler chain."""
    rows = model.rows(1)  # a fresh sequence of the model's context (no decoding through our loop)
    context, seq = model._context, rows.seq[0]
    chain = llama.llama_sampler_chain_init(llama.llama_sampler_chain_default_params())
    if temperature == 0:
        llama.llama_sampler_chain_add(chain, llama.llama_sampler_init_greedy())
    else:
        llama.llama_sampler_chain_add(chain, llama.llama_sampler_init_temp(temperature))
        llama.llama_sampler_chain_add(chain, llama.llama_sampler_init_dist(seed))
    batch = llama.llama_batch_init(len(prompt), 0, 1)
    out: list[int] = []
    start = time.perf_counter()
    try:
        pending, position = prompt, 0
        while len(out) < tokens:
            for i, token in enumerate(pending):
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, position + i, 1
                batch.seq_id[i][0], batch.logits[i] = seq, i == len(pending) - 1
            batch.n_tokens = len(pending)
            if llama.llama_decode(context, batch) != 0:
                raise RuntimeError("llama_decode failed")
            position += len(pending)
            token = llama.llama_sampler_sample(chain, context, -1)
            out.append(token)
            if token in eos:
                break
            pending = [token]
    finally:
        seconds = time.perf_counter() - start
        llama.llama_batch_free(batch)
        llama.llama_sampler_free(chain)
    return SequenceStats(new_tokens=len(out), target_forwards=len(out), wall_time=seconds), seconds


# The speed schedule's costs, remembered from call to call as `diversed generate` and `diversed serve` do (in
# memory only: the run starts from none).
REMEMBERED = CostMemory()


def ours(pair: Pair, prompt: list[int], spec: str, tokens: int, temperature: float, seed: int, head
         ) -> tuple[SequenceStats, float]:
    verification, drafting = spec.split("@")[:2]
    if drafting == "default":
        length = DEFAULT_DRAFTING[pair.backend]
    elif drafting.partition(":")[0] in ("speed", "auto"):  # "auto:N", its name in older results' commands
        length = Drafting(int(drafting.partition(":")[2]), "speed", maximum=8)
    else:
        length = Drafting(int(drafting)) if drafting != "-" else Drafting(1)
    start = time.perf_counter()
    out = decode(pair.target, [prompt], draft=pair.draft, verification=Verification.parse(verification),
                 sampling=Sampling(temperature), drafting=length, max_new_tokens=tokens,
                 eos_token_ids=pair.eos_token_ids, head=head if verification == "diversed" else None, seed=seed,
                 costs=REMEMBERED)
    return out.stats[0], time.perf_counter() - start


def speculative_simple(binary: str, draft: Path, target: Path, text: str, n_max: int, tokens: int,
                       temperature: float, seed: int) -> tuple[SequenceStats, float]:
    """llama.cpp's own speculative decoding; its encode + decode time as it reports them."""
    command = [binary, "-m", str(target), "-md", str(draft), "--spec-type", "draft-simple",
               "--spec-draft-n-max", str(n_max), "-n", str(tokens), "--temp", str(temperature), "--seed", str(seed),
               "-t", str(default_threads()), "-c", "4096", "-p", text]
    log = subprocess.run(command, capture_output=True, text=True, check=True).stderr
    encoded = float(re.search(r"encoded\s+\d+ tokens in\s+([\d.]+) seconds", log).group(1))
    decoded, seconds = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds", log).groups()
    drafted = int(re.search(r"n_drafted = (\d+)", log).group(1))
    accepted = int(re.search(r"n_accept  = (\d+)", log).group(1))
    total = encoded + float(seconds)
    return SequenceStats(new_tokens=int(decoded), drafted=drafted, accepted=accepted, wall_time=total), total


WIDTHS = (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 48, 64)


def width_profile(pairs: dict[str, Pair], prompt: list[int], widths: tuple[int, ...] = WIDTHS, repeats: int = 7
                  ) -> str:
    """The costs that bound speculation here, medians of `repeats` taking turns: the target's pass over k
    tokens (k in `widths`, which must hold 1 to 5) and each draft's step, after `prompt`; and the speedup over
    the target alone that rounds of N drafts would give if every draft were kept,
    (N + 1) v(1) / (N d + v(N + 1))."""
    target = next(iter(pairs.values())).target
    rows = {"target": target.rows(1), **{name: pair.draft.rows(1) for name, pair in pairs.items()}}
    for state in rows.values():
        state.feed([prompt], 1)
    held = len(prompt)

    def timed(state, width: int) -> float:
        start = time.perf_counter()
        state.feed([prompt[-width:]], 1)
        seconds = time.perf_counter() - start
        state.truncate([held])
        return seconds

    times: dict[str, list[float]] = {}
    for _ in range(repeats):
        for k in widths:
            times.setdefault(f"v({k})", []).append(timed(rows["target"], k))
        for name in pairs:
            times.setdefault(name, []).append(timed(rows[name], 1))
    ms = {key: 1000 * sorted(values)[len(values) // 2] for key, values in times.items()}
    lines = [f"\nCosts after a {held}-token prompt (ms, medians of {repeats})",
             "| target pass over k tokens | " + " | ".join(str(k) for k in widths) + " |",
             "|---" * (len(widths) + 1) + "|",
             "| ms | " + " | ".join(f"{ms[f'v({k})']:.0f}" for k in widths) + " |",
             "", "| draft | step (ms) | ceiling N = 1 | N = 2 | N = 3 | N = 4 |", "|---|---|---|---|---|---|"]
    for name in pairs:
        d = ms[name]
        ceilings = [(n + 1) * ms["v(1)"] / (n * d + ms[f"v({n + 1})"]) for n in range(1, 5)]
        lines.append(f"| {name} | {d:.0f} | " + " | ".join(f"{c:.2f}x" for c in ceilings) + " |")
    return "\n".join(lines)


def prompt_sets(humaneval: int, gsm8k: int) -> dict[str, list[str]]:
    """Held-out prompts: the first of HumanEval's test split (task numbers divisible by 4) and of GSM8K's."""
    return {"humaneval": [e.prompt for e in get_task("humaneval").examples("test", limit=humaneval)],
            "gsm8k": [e.prompt for e in get_task("gsm8k").examples("test", limit=gsm8k)]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--humaneval", type=int, default=6)
    parser.add_argument("--gsm8k", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    parser.add_argument("--ours", nargs="+", default=list(OURS), help="verification@drafting: N, speed:N, default or -")
    parser.add_argument("--speculative-simple", help="path of llama.cpp's llama-speculative-simple")
    parser.add_argument("--spec-n", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--transformers", nargs="*", default=["plain@-", "exact@default"])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    pair = load_pair(backend="llama.cpp", cache_ram=0)  # every prompt read whole, as plain llama.cpp does
    quantized = {q: load_pair(backend="llama.cpp", draft_quant=q, cache_ram=0)
                 for q in {s.split("@")[2] for s in args.ours if s.count("@") == 2}}
    head = load_head(pair)
    bare_target = LlamaCppModel(default_gguf_pair()[1], "target, no extra buffers", extra_buffers=False)
    hf_pair = load_pair(backend="transformers", cache_ram=0) if args.transformers else None
    sets = prompt_sets(args.humaneval, args.gsm8k)
    eos = set(pair.eos_token_ids)
    profile = width_profile({"Q4_K_M": pair} | quantized, encode_prompt(pair.tokenizer, sets["humaneval"][0]))
    print(profile, flush=True)
    report = {"machine": describe(),
              "tokens": args.tokens, "costs": profile, "results": []}
    for temperature in args.temperatures:
        for set_name, texts in sets.items():
            runs = configurations(args, pair, quantized, hf_pair, head, temperature, eos, bare_target)
            rows = {name: Row(name) for name in runs}
            for i, text in enumerate(texts):
                ids = encode_prompt(pair.tokenizer, text)
                chat = pair.tokenizer.decode(ids)
                order = list(runs) if i % 2 == 0 else list(reversed(runs))
                for name in order:
                    stats, seconds = runs[name](ids, chat, 1000 + i)
                    rows[name].add(stats, seconds)
                print(f"T = {temperature} {set_name}: prompt {i + 1}/{len(texts)} done", flush=True)
            print(table(rows, temperature, set_name), flush=True)
            for row in rows.values():
                summary = summarize(row.stats, row.seconds)
                report["results"].append({"temperature": temperature, "prompts": set_name, "config": row.name,
                                          "tokens_per_s": row.tokens_per_s,
                                          "vs_plain": row.tokens_per_s / rows["plain llama.cpp"].tokens_per_s,
                                          **{k: summary[k] for k in ("new_tokens", "acceptance_rate", "tau",
                                                                     "drafted", "accepted")}})
            if args.out:
                args.out.write_text(json.dumps(report, indent=1) + "\n")


def configurations(args: argparse.Namespace, pair: Pair, quantized: dict[str, Pair], hf_pair: Pair | None, head,
                   temperature: float, eos: set[int], bare_target: LlamaCppModel) -> dict:
    """name -> run(prompt ids, prompt text, seed) -> (stats, seconds), for every configuration asked for."""
    tokens = args.tokens
    runs = {"plain llama.cpp": lambda ids, text, seed: plain_llama(pair.target, ids, tokens, temperature, seed, eos),
            "plain llama.cpp, no extra buffers": lambda ids, text, seed: plain_llama(
                bare_target, ids, tokens, temperature, seed, eos)}
    for spec in args.ours:
        used = quantized[spec.split("@")[2]] if spec.count("@") == 2 else pair
        runs[f"ours {spec}"] = (lambda ids, text, seed, spec=spec, used=used:
                                ours(used, ids, spec, tokens, temperature, seed, head))
    if args.speculative_simple:
        draft, target = default_gguf_pair()
        for n in args.spec_n:
            runs[f"llama.cpp-spec n-max {n}"] = (lambda ids, text, seed, n=n: speculative_simple(
                args.speculative_simple, draft, target, text, n, tokens, temperature, seed))
    for spec in args.transformers:
        runs[f"transformers {spec}"] = (lambda ids, text, seed, spec=spec:
                                        ours(hf_pair, ids, spec, tokens, temperature, seed, None))
    return runs


def table(rows: dict[str, Row], temperature: float, set_name: str) -> str:
    plain = rows["plain llama.cpp"].tokens_per_s
    lines = [f"\n{set_name}, T = {temperature}, {len(next(iter(rows.values())).stats)} prompts",
             "| configuration | tokens | tokens/s | vs plain llama.cpp | acceptance | tau |",
             "|---|---|---|---|---|---|"]
    for row in rows.values():
        s = summarize(row.stats, row.seconds)
        acceptance = "-" if s["acceptance_rate"] is None else f"{s['acceptance_rate']:.1%}"
        tau = "-" if not s["target_forwards"] else f"{s['tau']:.2f}"
        lines.append(f"| {row.name} | {s['new_tokens']} | {row.tokens_per_s:.2f} | {row.tokens_per_s / plain:.2f}x "
                     f"| {acceptance} | {tau} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()

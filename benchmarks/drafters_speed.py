"""Zero-cost drafters on llama.cpp, in one interleaved run on one machine: plain llama.cpp, llama.cpp's own
draftless speculative decoding (`llama-server --spec-type ngram-*`), and `diversed` with each drafter, on
five workloads: whole-file edits (file-edit: most of the answer is a copy of the file in the prompt), code
edits (mbpp-edit), revisions in a conversation (mbpp-edit-2turn), GSM8K and HumanEval (novel code, where
copying finds little).

Per workload and temperature, one row per configuration: tokens/s (new tokens over the wall time of the
whole generation, prompt processing included, for every engine alike), time per prompt, acceptance, tokens
per verify pass (tau), the ratio to plain llama.cpp, the decode rate (tokens after the first over the time
after the prompt pass, the target's pass over each prompt timed once on our backend and taken out of every
configuration's time alike) and its ratio, and for relaxed rules nothing about quality (that is
`diversed eval`'s job: benchmarks/results/file-edit-t0.7 has pass rates). Configurations take turns prompt by prompt,
the order reversing every prompt, so that a slow spell of the machine spreads over all of them.

- plain llama.cpp: llama_speed.plain_llama (llama-cpp-python's low-level API, llama.cpp's sampler chain).
- llama-server MODE: one server per mode, all loaded before the run (idle ones cost nothing), given the same
  token ids on /completion with prompt caching off; its time is its reported prompt and generation time.
  Each mode's setting is the fastest of a small grid (MODE_GRID) on tuning prompts (`--tune-task`'s *train*
  problems, never the measured ones), chosen by `--tune` before the run and printed with it.
- ours DRAFTER VERIFICATION: `diversed.decode` with the default drafting of `diversed generate` on llama.cpp (the
  auto schedule); a fresh suffix cache per prompt, as one `diversed generate` call has. `repeat`: the same
  request sent a second time to a server, whose suffix cache holds the first answer (at T = 0 the answer
  repeats in full; at T = 1 with another seed, in part). `prediction`: the request sends the file it shows
  as its prediction (OpenAI's Predicted Outputs; file-edit only).
- oracle: the ceiling of copying: for the text `ours auto exact` wrote (greedy: the target's), a drafter that
  knows how many tokens of the better of lookup's and the suffix cache's proposals will be kept drafts exactly
  those when that is faster, priced with the verify times measured here at a few contexts (`costs`, linear
  between them: a pass costs more the more it attends over); its time is the cheapest sequence of rounds
  (dynamic programming over positions), plus the prompt pass as timed for the decode rate.

    .venv/bin/python benchmarks/drafters_speed.py --llama-server PATH/llama-server \
        --out benchmarks/results/drafters-speed.json
"""

from __future__ import annotations

import argparse
import json
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from llama_speed import Row, plain_llama
from serve_speed import free_port, start

from diversed.backends.llama_cpp import default_threads
from diversed.decoding.drafters.lookup import LookupDrafter
from diversed.decoding.drafters.prediction import PredictionDrafter
from diversed.decoding.drafters.suffix import SuffixCache, SuffixDrafter
from diversed.decoding.engine import decode
from diversed.decoding.metrics import SequenceStats, summarize
from diversed.decoding.schedule import CostMemory
from diversed.machine import describe
from diversed.models.default_pair import default_gguf_pair
from diversed.models.loading import Pair, load_pair
from diversed.request import DEFAULT_DRAFTING, Sampling, Verification
from diversed.tasks import get_task
from diversed.text import encode_messages, encode_prompt

OURS = ("lookup exact", "suffix exact", "model exact", "auto exact", "auto lossy:0.5", "auto static:0.7",
        "auto exact repeat", "auto exact prediction", "auto lossy:0.5 prediction", "auto static:0.7 prediction")
# Verify passes timed for the oracle (its drafts: one fewer): every width up to 16, then llama.cpp's cheapest,
# the multiples of its pass_tile, and the widest.
WIDTHS = (*range(1, 17), 24, 32, 48, 64, 65)
# llama-server's n-gram modes and the settings tried for each (its defaults, made for GPUs, last); `--grid
# small` (long answers, where each try takes a minute) tries the short-answer winner of the earlier runs and
# the defaults only, and ngram-map-k (last in every earlier run) at its defaults.
MODE_GRID = {
    "ngram-simple": [["--spec-ngram-simple-size-n", str(n), "--spec-ngram-simple-size-m", str(m),
                      "--spec-draft-n-max", str(m)] for n, m in ((3, 4), (4, 8), (6, 8), (12, 48))],
    "ngram-map-k": [["--spec-ngram-map-k-size-n", str(n), "--spec-ngram-map-k-size-m", str(m),
                     "--spec-draft-n-max", str(m)] for n, m in ((3, 4), (4, 8), (6, 8), (12, 48))],
    "ngram-mod": [["--spec-ngram-mod-n-match", str(k), "--spec-ngram-mod-n-min", str(lo),
                   "--spec-ngram-mod-n-max", str(hi)] for k, lo, hi in ((6, 2, 8), (12, 4, 16), (24, 48, 64))],
}
SMALL_GRID = {"ngram-simple": [MODE_GRID["ngram-simple"][1], MODE_GRID["ngram-simple"][-1]],
              "ngram-map-k": MODE_GRID["ngram-map-k"][-1:],
              "ngram-mod": MODE_GRID["ngram-mod"][1:]}


def workloads(sizes: dict[str, int]) -> dict[str, list]:
    """Held-out examples per workload (their prompts: strings for the chat template, or chat messages)."""
    return {name: get_task(name).examples("test", limit=size) for name, size in sizes.items() if size}


def token_ids(pair: Pair, prompt) -> list[int]:
    if isinstance(prompt, list):
        return encode_messages(pair.tokenizer, prompt)
    return encode_prompt(pair.tokenizer, prompt)


def ours(pair: Pair, ids: list[int], spec: str, tokens: int, temperature: float, seed: int,
         prediction: list[int] | None = None, remembered: CostMemory | None = None
         ) -> tuple[SequenceStats, float, list[int]]:
    """One `diversed.decode` call for 'DRAFTER VERIFICATION'; 'DRAFTER VERIFICATION repeat': the same request a
    second time, timed, after a first (untimed) one has filled the suffix cache they share, as in `diversed serve`;
    'DRAFTER VERIFICATION prediction': with `prediction` (token ids) as the request's predicted output."""
    drafter, verification, *extra = spec.split()
    repeat = "repeat" in extra
    cache = SuffixCache()
    options = dict(draft=pair.draft, drafter=drafter, cache=cache, verification=Verification.parse(verification),
                   sampling=Sampling(temperature), drafting=DEFAULT_DRAFTING[pair.backend],
                   max_new_tokens=tokens, eos_token_ids=pair.eos_token_ids,
                   predictions=[prediction] if "prediction" in extra else None, costs=remembered)
    if repeat:
        decode(pair.target, [ids], seed=seed + 1, **options)
    start = time.perf_counter()
    out = decode(pair.target, [ids], seed=seed, **options)
    return out.stats[0], time.perf_counter() - start, out.tokens[0]


class LlamaServer:
    """llama.cpp's server with one speculative mode, on this machine's threads."""

    def __init__(self, binary: str, target: Path, mode: str, setting: list[str]) -> None:
        self.port = free_port()
        command = [binary, "-m", str(target), "-t", str(default_threads()), "-c", "4096", "--port", str(self.port),
                   "-np", "1", "--no-webui"]
        if mode != "none":
            command += ["--spec-type", mode, *setting]
        self.process = start(command, self.port)

    def run(self, ids: list[int], tokens: int, temperature: float, seed: int
            ) -> tuple[SequenceStats, float, list[int]]:
        body = {"prompt": ids, "n_predict": tokens, "temperature": temperature, "top_k": 0, "top_p": 1.0,
                "min_p": 0.0, "seed": seed, "cache_prompt": False, "return_tokens": True}
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}/completion", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=600) as response:
            reply = json.loads(response.read())
        timings = reply["timings"]
        seconds = (timings["prompt_ms"] + timings["predicted_ms"]) / 1000
        stats = SequenceStats(new_tokens=timings["predicted_n"], drafted=timings.get("draft_n", 0),
                              accepted=timings.get("draft_n_accepted", 0), wall_time=seconds)
        return stats, seconds, reply.get("tokens", [])

    def close(self) -> None:
        self.process.terminate()
        self.process.wait()


SHOWN = (1, 4, 8, 16, 32, 48, 65)  # the widths a table's caption lists


@dataclass
class VerifyCosts:
    """Seconds of the target's verify pass by context (tokens already held) and width (tokens fed, the
    logits of all returned), measured at a few contexts; between them linear in the context, as attention's
    share of a pass is, and beyond them the nearest two's line extended."""
    by_context: dict[int, dict[int, float]]

    @classmethod
    def from_report(cls, path: Path) -> VerifyCosts:
        """The costs an earlier run timed, from its report (`costs_ms`: milliseconds by context and width)."""
        return cls({int(context): {int(k): ms / 1000 for k, ms in row.items()}
                    for context, row in json.loads(path.read_text())["costs_ms"].items()})

    @property
    def widths(self) -> list[int]:
        return sorted(next(iter(self.by_context.values())))

    def at(self, width: int, context: int) -> float:
        points = sorted(self.by_context)
        if len(points) == 1:
            return self.by_context[points[0]][width]
        right = next((i for i, c in enumerate(points) if c >= context), len(points) - 1)
        low, high = points[max(right - 1, 0)], points[max(right, 1)]
        a, b = self.by_context[low][width], self.by_context[high][width]
        return a + (b - a) * (context - low) / (high - low)

    def seconds(self, width: int, context: int) -> float:
        """A pass at any width up to the widest timed, after `context` tokens: linear between the nearest timed
        widths, each as `at` prices it."""
        widths = self.widths
        if width in widths:
            return self.at(width, context)
        low = max(k for k in widths if k < width)
        high = min(k for k in widths if k > width)
        a, b = self.at(low, context), self.at(high, context)
        return a + (b - a) * (width - low) / (high - low)

    def flat(self) -> dict[int, float]:
        """Seconds by width, where the passes were timed at one context only."""
        (row,) = self.by_context.values()
        return row

    def ms(self) -> dict[int, dict[int, float]]:
        return {c: {k: 1000 * v for k, v in row.items()} for c, row in self.by_context.items()}

    def line(self) -> str:
        return "; ".join(f"context {c}: " + ", ".join(f"{k}: {v:.0f}" for k, v in row.items() if k in SHOWN)
                         for c, row in self.ms().items())


def verify_costs(pair: Pair, ids: list[int], widths=WIDTHS, repeats: int = 5,
                 contexts: tuple[int, ...] | None = None) -> VerifyCosts:
    """The target's pass over k tokens (k in widths) after a context, returning the logits of all k as a verify
    pass does, seconds, medians of `repeats`; at each of `contexts` (the prompt's tokens, cycled to that
    length; attention's cost depends on the length, not the text), or after `ids` alone."""
    by_context = {}
    for length in contexts or (len(ids),):
        held_ids = (ids * (length // len(ids) + 1))[:length]
        rows = pair.target.rows(1)
        rows.feed([held_ids], 1)
        times = {k: [] for k in widths}
        for _ in range(repeats):
            for k in times:
                start = time.perf_counter()
                rows.feed([held_ids[-k:]], k)
                times[k].append(time.perf_counter() - start)
                rows.truncate([length])
        by_context[length] = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
        del rows
    return VerifyCosts(by_context)


def oracle_seconds(ids: list[int], written: list[int], costs: VerifyCosts, cache: SuffixCache,
                   prediction: list[int] | None = None) -> float:
    """The fastest copying could write `written` after `ids` once the prompt pass wrote its first token: each
    position's best proposal (lookup, the suffix cache or the prediction) matched against what follows; a
    round drafts n <= matched tokens and writes n + 1 for the pass at width n + 1, priced at the context the
    pass runs at (the cheapest plan over positions, by dynamic programming)."""
    drafters = [LookupDrafter(), SuffixDrafter(cache), PredictionDrafter()]
    for drafter in drafters:
        drafter.add(ids, prediction)
        drafter.advance([written[:1]])
    written = written[1:]
    widths = set(costs.widths)
    longest = max(widths) - 1
    matched = []
    for i in range(len(written)):
        best = 0
        for drafter in drafters:
            (candidate,) = drafter.candidates([longest])
            if candidate is not None:
                best = max(best, _prefix(candidate.tokens, written[i:]))
        matched.append(best)
        for drafter in drafters:
            drafter.advance([written[i:i + 1]])
    suffix = drafters[1]
    suffix.select([])
    end = len(written)
    fastest = [0.0] * (end + 1)
    for i in range(end - 1, -1, -1):
        context = len(ids) + 1 + i  # the prompt and the first token are held, then i written tokens
        fastest[i] = min(costs.at(n + 1, context) + fastest[min(i + n + 1, end)]
                         for n in range(min(matched[i], longest) + 1) if n + 1 in widths)
    return fastest[0]


def _prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def tune(binary: str, target: Path, pair: Pair, prompts: list, tokens: int, grids: dict = MODE_GRID
         ) -> dict[str, list[str]]:
    """Each llama-server mode's fastest setting of its grid at T = 0 on tuning prompts (none: the first)."""
    if not prompts:
        return {mode: grid[0] for mode, grid in grids.items()}
    chosen = {}
    for mode, grid in grids.items():
        speeds = []
        for setting in grid:
            server = LlamaServer(binary, target, mode, setting)
            try:
                runs = [server.run(token_ids(pair, p), tokens, 0.0, 0) for p in prompts]
            finally:
                server.close()
            speed = sum(s.new_tokens for s, _, _ in runs) / sum(t for _, t, _ in runs)
            speeds.append(speed)
            print(f"tune {mode} {' '.join(setting)}: {speed:.2f} tokens/s", flush=True)
        chosen[mode] = grid[max(range(len(grid)), key=speeds.__getitem__)]
    return chosen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama-server", help="path of llama.cpp's llama-server (omit: no llama-server rows)")
    parser.add_argument("--file-edit", type=int, default=8)
    parser.add_argument("--edit", type=int, default=6)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--gsm8k", type=int, default=3)
    parser.add_argument("--humaneval", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=192)
    parser.add_argument("--file-edit-tokens", type=int, default=1024, help="the most new tokens of a file-edit "
                                                                            "answer (a whole file)")
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    parser.add_argument("--sampled-workloads", nargs="+", default=["file-edit", "mbpp-edit", "humaneval"],
                        help="the workloads also run at temperatures above 0")
    parser.add_argument("--ours", nargs="+", default=list(OURS), help="'DRAFTER VERIFICATION' pairs")
    parser.add_argument("--tune", type=int, default=3, help="train prompts to choose llama-server's settings")
    parser.add_argument("--tune-task", default="mbpp-edit", help="the task whose train prompts tune llama-server")
    parser.add_argument("--grid", choices=("full", "small"), default="full", help="llama-server settings to tune")
    parser.add_argument("--settings", type=Path, help="take llama-server's settings from an earlier run's JSON "
                                                      "(its llama_server_settings) instead of tuning")
    parser.add_argument("--cost-contexts", type=int, nargs="+", default=[256, 1024, 2048],
                        help="contexts at which verify passes are timed for the oracle (priced between them)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    pair = load_pair(backend="llama.cpp", cache_ram=0)  # every prompt read whole, as the peers do
    _, target_gguf = default_gguf_pair()
    sets = workloads({"file-edit": args.file_edit, "mbpp-edit": args.edit, "mbpp-edit-2turn": args.turns,
                      "gsm8k": args.gsm8k, "humaneval": args.humaneval})
    costs = verify_costs(pair, token_ids(pair, next(iter(sets.values()))[0].prompt_for(chat=True)),
                         contexts=tuple(args.cost_contexts))
    print(f"verify pass by context and width (ms): {costs.line()}", flush=True)
    report = {"machine": describe(), "tokens": args.tokens, "costs_ms": costs.ms(), "results": []}
    servers = {}
    if args.llama_server:
        tuning = [e.prompt_for(chat=True) for e in get_task(args.tune_task).examples("train", limit=args.tune)] \
            if args.tune else []
        tune_tokens = args.file_edit_tokens if args.tune_task == "file-edit" else args.tokens
        settings = (json.loads(args.settings.read_text())["llama_server_settings"] if args.settings else
                    tune(args.llama_server, target_gguf, pair, tuning, tune_tokens,
                         SMALL_GRID if args.grid == "small" else MODE_GRID))
        report["llama_server_settings"] = settings
        servers = {mode: LlamaServer(args.llama_server, target_gguf, mode, setting)
                   for mode, setting in {"none": [], **settings}.items()}
    eos = set(pair.eos_token_ids)
    try:
        for temperature in args.temperatures:
            for name, prompts in sets.items():
                if temperature > 0 and name not in args.sampled_workloads:
                    continue
                rows, oracle, prompt = run_workload(args, pair, servers, prompts, temperature, eos, costs)
                print(table(rows, oracle, prompt, temperature, name), flush=True)
                plain = rows["plain llama.cpp"]
                for row in rows.values():
                    summary = summarize(row.stats, row.seconds)
                    report["results"].append({
                        "temperature": temperature, "prompts": name, "config": row.name,
                        "tokens_per_s": row.tokens_per_s, "seconds_per_prompt": row.seconds / len(row.stats),
                        "vs_plain": row.tokens_per_s / plain.tokens_per_s,
                        "decode_tokens_per_s": decode_rate(row, prompt), "prompt_seconds": prompt,
                        **{k: summary[k] for k in ("new_tokens", "acceptance_rate", "tau", "drafted", "accepted",
                                                   "rule_tokens", "target_tokens", "drafters")}})
                report["results"].append({"temperature": temperature, "prompts": name, "config": "oracle",
                                          "tokens_per_s": oracle.tokens_per_s,
                                          "vs_plain": oracle.tokens_per_s / plain.tokens_per_s,
                                          "decode_tokens_per_s": decode_rate(oracle, prompt), "prompt_seconds": prompt})
                if args.out:
                    args.out.write_text(json.dumps(report, indent=1) + "\n")
    finally:
        for server in servers.values():
            server.close()


def run_workload(args, pair: Pair, servers: dict, examples: list, temperature: float, eos: set[int],
                 costs: VerifyCosts) -> tuple[dict[str, Row], Row, float]:
    """Every configuration on every prompt of one workload, interleaved; the oracle's (priced) row; and the
    seconds of the target's prompt passes, all prompts'."""
    file_edit = "original" in examples[0].metadata
    # The speed schedule's costs, remembered from call to call as `diversed generate` and `diversed serve` do
    # (in memory only: the run starts from none; the warm-up below times them).
    remembered = CostMemory()
    tokens = args.file_edit_tokens if file_edit else args.tokens
    runs = {"plain llama.cpp": lambda ids, seed, _: (*plain_llama(pair.target, ids, tokens, temperature, seed, eos),
                                                     None)}
    for mode, server in servers.items():
        runs["llama-server" if mode == "none" else f"llama-server {mode}"] = (
            lambda ids, seed, _, server=server: server.run(ids, tokens, temperature, seed))
    for spec in args.ours:
        if "prediction" not in spec or file_edit:
            runs[f"ours {spec}"] = lambda ids, seed, predicted, spec=spec: ours(pair, ids, spec, tokens, temperature,
                                                                                seed, predicted, remembered)
    warm = token_ids(pair, examples[0].prompt_for(chat=True))
    for name in runs:  # the auto schedule's costs and llama.cpp's buffers, before anything is timed
        if name.startswith("ours"):
            runs[name](warm[:64], 0, warm[:32])
    rows = {name: Row(name) for name in runs}
    written, oracle, prompt_total = {}, Row("oracle (copying, ceiling)"), 0.0
    for i, example in enumerate(examples):
        ids = token_ids(pair, example.prompt_for(chat=True))
        prompt = prompt_seconds(pair, ids)
        prompt_total += prompt
        predicted = pair.tokenizer(example.metadata["original"], add_special_tokens=False)["input_ids"] \
            if file_edit else None
        order = list(runs) if i % 2 == 0 else list(reversed(runs))
        for name in order:
            stats, seconds, out = runs[name](ids, 1000 + i, predicted)
            rows[name].add(stats, seconds)
            written[name] = out
        # The oracle writes what our exact auto run wrote (plain llama.cpp returns no tokens): its first token
        # with the prompt pass, then the cheapest rounds.
        text = written.get("ours auto exact") or []
        oracle.add(SequenceStats(new_tokens=len(text)), prompt + oracle_seconds(ids, text, costs, SuffixCache(),
                                                                                 predicted))
        print(f"T = {temperature}: prompt {i + 1}/{len(examples)} done", flush=True)
    return rows, oracle, prompt_total


def prompt_seconds(pair: Pair, ids: list[int]) -> float:
    """The target's pass over a prompt, which writes the first token: what every engine pays before decoding."""
    rows = pair.target.rows(1)
    start = time.perf_counter()
    rows.feed([ids], 1)
    return time.perf_counter() - start


def decode_rate(row: Row, prompt: float) -> float:
    """Tokens after each prompt's first over the time after its prompt pass (`prompt`: all prompts' passes):
    decoding alone, without the prompt pass that every engine pays alike."""
    return sum(s.new_tokens - 1 for s in row.stats) / max(row.seconds - prompt, 1e-9)


def table(rows: dict[str, Row], oracle: Row, prompt: float, temperature: float, name: str) -> str:
    plain = rows["plain llama.cpp"]
    count = len(plain.stats)
    lines = [f"\n{name}, T = {temperature}, {count} prompts (prompt pass {prompt / count:.2f} s a prompt)",
             "| configuration | tokens/s | s per prompt | vs plain | decode tokens/s | decode vs plain | acceptance "
             "| tau | kept/drafted |", "|---|---|---|---|---|---|---|---|---|"]
    for row in [*rows.values(), oracle]:
        summary = summarize(row.stats, row.seconds)
        rate = "-" if summary["acceptance_rate"] is None else f"{summary['acceptance_rate']:.0%}"
        tau = "-" if not summary["target_forwards"] else f"{summary['tau']:.2f}"
        kept = "" if row is oracle else f"{summary['accepted']}/{summary['drafted']}"
        lines.append(f"| {row.name} | {row.tokens_per_s:.2f} | {row.seconds / count:.2f} | "
                     f"{row.tokens_per_s / plain.tokens_per_s:.2f}x | {decode_rate(row, prompt):.2f} | "
                     f"{decode_rate(row, prompt) / decode_rate(plain, prompt):.2f}x | {rate} | {tau} | {kept} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()

"""Speed of speculative decoding on a draft/target pair, against plain decoding and transformers' own
assisted generation, in one run on one machine.

Prints, per temperature: the per-forward costs (draft step, target step, target verify pass of N+1
tokens; medians of timings taken between the chunks of prompts of the run itself), then one row per
configuration: acceptance rate, tau, tokens/s, speedup over "plain", the speedup that the speed model
(diversed.decoding.schedule, Leviathan et al. with the measured verify cost) predicts from the measured costs and
per-position acceptance, and the share of our rounds spent outside the two models' forwards (the engine's
phase profile). Rows named hf-* are transformers' generate(assistant_model=...). Batch-1 configurations
take turns prompt by prompt (the order reversing every prompt), so that a slow spell of a shared machine
spreads over all of them.

    .venv/bin/python benchmarks/speed.py --prompts 10 --draftings 5 auto:5 20/0.4 --main 20/0.4 --heads packaged \
        --batch 8 --peers hf-default hf-exact --dtypes float16 bfloat16

speedup = (tokens/s of the verification) / (tokens/s of plain): the ratio of wall times per generated token, which
equals the ratio of wall times when both write the same number of tokens (sampled runs stop at EOS at
different times, so per-token time is the fair comparison).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from diversed.admission import load_head
from diversed.backends import Model, Rows, as_model
from diversed.decoding.engine import decode
from diversed.decoding.metrics import summarize
from diversed.evaluation.peer import assisted_generate
from diversed.evaluation.run import parse_verifications
from diversed.machine import describe
from diversed.models.default_pair import prepare_default_pair
from diversed.models.loading import Pair, load_model, load_pair
from diversed.models.options import DTYPE_NAMES
from diversed.request import Drafting, Sampling, Verification
from diversed.tasks.humaneval import chat_prompt, load_humaneval
from diversed.text import encode_prompt


@dataclass(frozen=True)
class Spec:
    """One configuration to time: a verification label (ours, or hf-exact / hf-static:W / hf-default for the
    peer), its draft length (None for plain and for the peer's own defaults), a batch size and the dtype of
    the models it runs on."""

    verification: str
    length: Drafting | None
    batch: int = 1
    draft_vocab: int | None = None  # the draft scores only its K most frequent tokens (diversed.models.vocab)
    dtype: str = "float16"

    @property
    def pair_key(self) -> tuple[str, int | None]:
        return self.dtype, self.draft_vocab

    @property
    def peer(self) -> bool:
        return self.verification.startswith("hf-")

    @property
    def drafting(self) -> str:
        if self.verification == "hf-default":
            return "20, cut-off 0.4"
        if self.length is None:
            return "-"
        return str(self.length) + (f", draft vocab {self.draft_vocab}" if self.draft_vocab else "")


@dataclass
class Row:
    spec: Spec
    stats: list = field(default_factory=list)
    wall_time: float = 0.0
    profile: dict = field(default_factory=dict)  # seconds per phase, summed over calls (ours only)

    @property
    def summary(self) -> dict:
        return summarize(self.stats, self.wall_time)

    @property
    def tokens_per_s(self) -> float:
        return self.summary["new_tokens"] / self.wall_time

    @property
    def overhead(self) -> float | None:
        """Share of the time spent outside the two models' forwards (issue 6's bar: under 5%)."""
        if not self.profile:
            return None
        return 1 - (self.profile["draft"] + self.profile["target forward"]) / self.profile["total"]


@torch.inference_mode()
def forward_costs(pair: Pair, prompt: list[int], draft_lens: list[int], repeats: int, context: int
                  ) -> dict[str, list[float]]:
    """Timings (seconds, `repeats` each) of one draft step, one target step and one target pass over N+1
    tokens, each with `context` tokens in the cache (the prompt, extended by repeating it: where decoding
    runs on average; the cache is rolled back after every timed call), and of each model's prefill of the
    prompt alone. The calls take turns, so that a slow spell of the machine hits all of them alike."""
    cached = (prompt * (context // len(prompt) + 1))[:max(context, len(prompt))]
    states = {"draft": _prefilled(pair.draft, cached), "target": _prefilled(pair.target, cached)}

    def step(role: str, width: int):
        held = len(cached)
        return lambda: (states[role].feed([prompt[-width:]], width), states[role].truncate([held]))

    calls = {"draft_step": step("draft", 1), "target_step": step("target", 1)}
    calls |= {f"verify_{n + 1}": step("target", n + 1) for n in draft_lens}
    prefills = {f"{role}_prefill": (lambda m=model: _prefilled(m, prompt))
                for role, model in (("draft", pair.draft), ("target", pair.target))}
    return _interleaved_timings(calls, repeats) | _interleaved_timings(prefills, 1)


def _interleaved_timings(calls: dict, repeats: int) -> dict[str, list[float]]:
    for fn in calls.values():
        fn()  # warm-up
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, fn in calls.items():
            times[name].append(_seconds(fn))
    return times


def _prefilled(model: Model, prompt: list[int]) -> Rows:
    rows = model.rows(1)
    rows.feed([prompt], 1)
    return rows


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run(pairs: dict[tuple[str, int | None], Pair], specs: list[Spec], prompts: list[list[int]], sampling: Sampling,
        max_new_tokens: int, seed: int, time_forwards: Callable[[int], dict[str, list[float]]]
        ) -> tuple[list[Row], dict[str, float]]:
    """Every spec on every prompt, interleaved so that slow spells of a shared machine spread over all specs:
    batch-1 specs take turns prompt by prompt, in an order that reverses every prompt (a steady drift then
    cancels out); batched specs run each chunk of prompts (the largest batch) after the batch-1 turns on it.
    After each chunk, time_forwards(repeats) times each forward `repeats` times more (at least 10 timings in
    all): the costs (medians of all its timings) then come from the same spells of the machine as the runs.
    pairs: the pair for each (dtype, draft vocabulary size) (None: the full draft). Returns the rows and the
    costs."""
    rows = [Row(spec) for spec in specs]
    timings: dict[str, list[float]] = {}
    singles, batched = [r for r in rows if r.spec.batch == 1], [r for r in rows if r.spec.batch > 1]
    chunk = max(spec.batch for spec in specs)
    repeats = max(2, math.ceil(10 / math.ceil(len(prompts) / chunk)))  # at least 10 timings of each in all
    for start in range(0, len(prompts), chunk):
        end = min(start + chunk, len(prompts))
        for first in range(start, end):
            for row in singles if first % 2 == 0 else singles[::-1]:
                _run(pairs, row, prompts, first, sampling, max_new_tokens, seed)
        for row in batched:
            for first in range(start, end, row.spec.batch):
                _run(pairs, row, prompts, first, sampling, max_new_tokens, seed)
        for name, seconds in time_forwards(repeats).items():
            timings.setdefault(name, []).extend(seconds)
        print(f"  {end}/{len(prompts)} prompts: " + ", ".join(
            f"{r.spec.verification} [{r.spec.drafting}] x{r.spec.batch} {r.spec.dtype} {r.tokens_per_s:.2f}"
            for r in rows), flush=True)
    return rows, {name: statistics.median(seconds) for name, seconds in timings.items()}


def _run(pairs: dict[tuple[str, int | None], Pair], row: Row, prompts: list[list[int]], first: int, sampling: Sampling,
         max_new_tokens: int, seed: int) -> None:
    """Run one spec on prompts[first:first + batch]; the seed of a batch is the seed plus its first prompt."""
    pair, batch = pairs[row.spec.pair_key], prompts[first:first + row.spec.batch]
    if row.spec.peer:
        _run_peer(pair, row, batch[0], sampling, max_new_tokens, seed + first)
    else:
        _run_ours(pair, row, batch, sampling, max_new_tokens, seed + first)


def _run_ours(pair: Pair, row: Row, prompts: list[list[int]], sampling: Sampling, max_new_tokens: int,
              seed: int) -> None:
    verification = Verification.parse(row.spec.verification)
    # A head is tiny: reloading it costs about 1 ms.
    head = load_head(pair, verification.head) if verification.name == "diversed" else None
    out = decode(pair.target, prompts, draft=pair.draft, verification=verification, sampling=sampling,
                 drafting=row.spec.length or Drafting(), max_new_tokens=max_new_tokens,
                 eos_token_ids=pair.eos_token_ids, head=head, seed=seed)
    row.stats += out.stats
    row.wall_time += out.wall_time
    for phase, seconds in out.profile.items():
        row.profile[phase] = row.profile.get(phase, 0.0) + seconds


def _run_peer(pair: Pair, row: Row, prompt: list[int], sampling: Sampling, max_new_tokens: int, seed: int) -> None:
    name, _, weight = row.spec.verification.partition(":")
    _, stats = assisted_generate(pair, prompt, sampling, draft_length=None if name == "hf-default" else
                                 row.spec.length.initial, weight=float(weight) if weight else None,
                                 max_new_tokens=max_new_tokens, seed=seed)
    row.stats.append(stats)
    row.wall_time += stats.wall_time


def predicted_speedup(row: Row, costs: dict[str, float], prompts: int) -> float | None:
    """The speedup the speed model expects: per prompt, plain decoding costs a target prefill plus one step
    per token; speculative decoding costs both prefills plus tokens / tau rounds of N draft steps and one
    verify pass, with tau = 1 + sum_k prod_{i<=k} a_i over the measured per-position acceptance a.
    Only for our runs at a constant N without cut-off, at batch 1, with the measured draft and verify pass."""
    length = row.spec.length
    if (row.spec.peer or length is None or length.schedule != "constant" or length.confidence or row.spec.batch != 1
            or row.spec.draft_vocab or f"verify_{length.initial + 1}" not in costs):
        return None
    summary = row.summary
    tokens = summary["new_tokens"] / prompts
    acceptance = torch.tensor([x or 0.0 for x in summary["per_position_acceptance"][: length.initial]], dtype=float)
    tau = float(1.0 + acceptance.cumprod(0).sum())
    plain = costs["target_prefill"] + tokens * costs["target_step"]
    rounds = tokens / tau
    speculative = (costs["target_prefill"] + costs["draft_prefill"]
                   + rounds * (length.initial * costs["draft_step"] + costs[f"verify_{length.initial + 1}"]))
    return plain / speculative


def table(rows: list[Row], costs: dict[str, dict[str, float]], prompts: int) -> str:
    """One line per row; speedup: over plain at batch 1 in the row's dtype; with several dtypes, also over
    plain at batch 1 in the first (the default a user gets)."""
    plains = {r.spec.dtype: r for r in rows if r.spec.verification == "plain" and r.spec.batch == 1}
    first = next(iter(plains.values()))
    several = len(plains) > 1
    lines = ["| method | drafts | batch | dtype | tokens | acceptance | tau | tokens/s | speedup | "
             + (f"vs plain {first.spec.dtype} | " if several else "") + "predicted | overhead |",
             "|---|---|---|---|---|---|---|---|---|" + ("---|" if several else "") + "---|---|"]
    for r in rows:
        s = r.summary
        cells = [r.spec.verification, r.spec.drafting, r.spec.batch, r.spec.dtype, s["new_tokens"],
                 _cell(s["acceptance_rate"], ".1%"), _cell(s["tau"], ".2f"), f"{r.tokens_per_s:.2f}",
                 f"{r.tokens_per_s / plains[r.spec.dtype].tokens_per_s:.2f}x"]
        cells += [f"{r.tokens_per_s / first.tokens_per_s:.2f}x"] if several else []
        cells += [_cell(predicted_speedup(r, costs[r.spec.dtype], prompts), ".2f", "x"), _cell(r.overhead, ".1%")]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)


def _cell(value: float | None, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def drafting(text: str) -> Drafting:
    """A drafting from the command line: "N" (N every round), "N/C" (N, a sequence stopping once a draft's
    probability is below C) or "auto:N" (the auto schedule from N)."""
    schedule, _, rest = text.rpartition(":")
    length, _, confidence = rest.partition("/")
    try:
        return Drafting(int(length), schedule or "constant", confidence=float(confidence or 0))
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"not a drafting (N, N/C or auto:N): {text!r} ({error})") from None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--draft")
    parser.add_argument("--target")
    parser.add_argument("--dtypes", nargs="+", default=["float16"], choices=DTYPE_NAMES,
                        help="run every configuration on the models in each (the first is the baseline)")
    parser.add_argument("--draft-int8", action=argparse.BooleanOptionalAction, default=True,
                        help="the draft in dynamic int8, as `diversed generate` runs it (default: on)")
    parser.add_argument("--prompts", type=int, default=10, help="HumanEval prompts")
    parser.add_argument("--split", default="test", choices=["train", "test"],
                        help="HumanEval split: test (held out, for tables) or train (for choosing settings)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    parser.add_argument("--draftings", type=drafting, nargs="+", default=[Drafting(3), Drafting(5)],
                        help="run exact with each: N, N/C (cut-off C) or auto:N (default: 3 5)")
    parser.add_argument("--main", type=drafting,
                        help="the drafting of the static, DIVERSED and batch rows (default: the first of --draftings)")
    parser.add_argument("--weights", type=float, nargs="*", default=[0.7, 0.5])
    parser.add_argument("--batch", type=int, default=4,
                        help="also run plain and every verification at the main drafting at this batch size")
    parser.add_argument("--heads", nargs="*", default=[],
                        help="DIVERSED heads to run (folders; 'packaged' for the head that ships with the package)")
    parser.add_argument("--draft-vocab", type=int, metavar="K",
                        help="also run exact at the main drafting with a draft that scores only its K most frequent "
                             "tokens")
    parser.add_argument("--peers", nargs="*",
                        help="transformers' assisted generation: hf-exact and hf-static:W at the first drafting's N, "
                             "hf-default (its own 20 drafts and 0.4 cut-off); default: hf-exact and hf-static:W for "
                             "each --weights; none: --peers")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="write all rows and costs as JSON here")
    args = parser.parse_args()

    pairs = {}
    for dtype in args.dtypes:
        pair = pairs[dtype, None] = load_pair(args.draft, args.target, backend="transformers", dtype=dtype,
                                              draft_int8=args.draft_int8, cache_ram=0)
        if args.draft_vocab:
            # Only the draft differs: load it a second time, restricted, and share the target.
            draft_name = args.draft or str(prepare_default_pair()[0])
            pairs[dtype, args.draft_vocab] = replace(pair, draft=as_model(load_model(
                draft_name, dtype=dtype, vocab=args.draft_vocab, int8=args.draft_int8)[1], cache_mib=0))
    problems = load_humaneval(args.split)[: args.prompts]
    prompts = [encode_prompt(pair.tokenizer, chat_prompt(p), chat=True) for p in problems]
    machine = (f"{describe()}, {torch.get_num_threads()} threads, "
               f"torch {torch.__version__}")
    # quantize_linears leaves a bfloat16 (or GPU) draft as it is.
    draft_kind = "int8 draft (float16, float32)" if args.draft_int8 else "the draft in the target's dtype"
    print(f"# {pair.draft_name} -> {pair.target_name}, {'/'.join(args.dtypes)} target, {draft_kind}, "
          f"{len(prompts)} HumanEval {args.split} prompts, {args.max_new_tokens} new tokens, {machine}\n")
    # Costs where decoding runs on average: after the prompt and half the new tokens.
    context = int(statistics.mean(map(len, prompts)) + args.max_new_tokens // 2)
    timed = sorted({d.initial for d in args.draftings if d.schedule == "constant" and not d.confidence})

    def time_forwards(repeats: int) -> dict[str, list[float]]:
        return {f"{dtype}/{name}": seconds for dtype in args.dtypes
                for name, seconds in forward_costs(pairs[dtype, None], prompts[0], timed, repeats=repeats,
                                                   context=context).items()}

    results = {"machine": machine, "dtypes": args.dtypes, "draft_int8": args.draft_int8, "cost_context": context,
               "costs": {}, "runs": {}}
    main_drafting = args.main or args.draftings[0]
    verifications = [f"static:{w}" for w in args.weights]
    verifications += ["diversed" if h == "packaged" else f"diversed:{h}" for h in args.heads]
    specs = [Spec("plain", None)] + [Spec("exact", d) for d in args.draftings]
    specs += [Spec(m, main_drafting) for m in verifications]
    if args.draft_vocab:
        specs.append(Spec("exact", main_drafting, draft_vocab=args.draft_vocab))
    if args.batch > 1:
        specs += [Spec("plain", None, args.batch)] + [Spec(m, main_drafting, args.batch)
                                                      for m in ["exact", *verifications]]
    peers = ["hf-exact"] + [f"hf-static:{w}" for w in args.weights] if args.peers is None else args.peers
    if not all(p.startswith("hf-") for p in peers):
        parser.error(f"--peers takes hf-exact, hf-static:W and hf-default, got {peers}")
    specs += [Spec(p, None if p == "hf-default" else Drafting(args.draftings[0].initial))
              for p in (parse_verifications(peers) if peers else [])]
    specs = [replace(spec, dtype=dtype) for spec in specs for dtype in args.dtypes]
    for temperature in args.temperatures:
        print(f"\n## T = {temperature}", flush=True)
        rows, timed_costs = run(pairs, specs, prompts, Sampling(temperature), args.max_new_tokens, args.seed,
                                time_forwards)
        costs: dict[str, dict[str, float]] = {}
        for key, seconds in timed_costs.items():
            dtype, _, name = key.partition("/")
            costs.setdefault(dtype, {})[name] = seconds
        print(f"\nForward costs with {context} tokens in the cache (medians of the timings taken between the "
              f"chunks of prompts; prefills: the first prompt, {len(prompts[0])} tokens):\n\n"
              "| dtype | forward | ms | / target step |\n|---|---|---|---|")
        for dtype, named in costs.items():
            for name, seconds in named.items():
                print(f"| {dtype} | {name} | {seconds * 1e3:.1f} | {seconds / named['target_step']:.2f} |")
        print("\n" + table(rows, costs, len(prompts)), flush=True)
        results["costs"][str(temperature)] = costs
        results["runs"][str(temperature)] = [
            # "method" names the verification, as in the runs committed under benchmarks/results.
            {"method": r.spec.verification, "drafts": r.spec.drafting, "batch": r.spec.batch, "dtype": r.spec.dtype,
             "draft_vocab": r.spec.draft_vocab, "wall_time": r.wall_time, "tokens_per_s": r.tokens_per_s,
             "predicted": predicted_speedup(r, costs[r.spec.dtype], len(prompts)),
             "profile": r.profile, **r.summary} for r in rows]
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

"""Choosing the copying drafters' prior acceptances on training prompts, by replay: no timing noise, no test
prompt seen.

At T = 0 with exact verification a text is the target's greedy text whatever is drafted, so a drafter's rounds
can be replayed over it offline: each round the copying drafters (prompt lookup and a fresh suffix cache, the
better candidate per round as the auto drafter takes it) propose, `copy_width` picks the width from the
measured verify costs, the round keeps the proposal's prefix that matches the text, and costs the measured
pass at its width. The decode time of a text is the sum over its rounds; plain decoding's is one pass over
one token per token. Prompt passes are left out (the same for both).

The rule, written before the run: every prior in PRIORS is replayed on the training texts of the four
workloads (mbpp-edit, mbpp-edit-2turn, GSM8K train, MBPP train for novel code); the prior with the best
worst-workload speedup (plain decode time over replayed decode time, pooled within a workload) is chosen,
ties going to the more pessimistic prior. The texts are the target's greedy answers (192 tokens at most) on
llama.cpp; the costs are the verify passes timed at the start of the run.

`--long`: the priors of long runs (base.RUN_PRIOR, the kinds ("run", 16) and ("run", 64)) and a prediction's two
priors (prediction.PRIOR, prediction.RUN_PRIOR) over the same workloads plus HumanEval train (the code a
HumanEval prompt asks for repeats its own lines) and whole-file edits (file-edit train, answers of up to 1,024
tokens, replayed with and without the file as prediction: `file-edit+prediction`); the base prior stays
base.PRIOR. Each choice takes, among the candidates whose replayed speedup is at least FLOOR (0.99x plain) on
every workload ("never slower than plain", with a margin no replay noise needs), the best geometric mean speedup
over the workloads (file edits count twice: two ways they are sent), ties (3 decimals) to the more pessimistic
priors; if no candidate clears the floor, the best worst workload. The rule, written 2026-12-06 before its run
(it replaces three stages run one after another, whose answers depended on their order and on the module's
defaults for what a stage did not vary): alternate (A) base.RUN_PRIOR over every workload, a prediction's two
priors held at their current choice, and (B) a prediction's two priors together, every pair of
PREDICTION_PRIORS x RUN_PRIORS over file-edit+prediction, base.RUN_PRIOR at A's choice; start from the shipped
values and stop when a round chooses what the round before it did (a fixed point), or after ROUNDS rounds (then
the last round's choice).

`--costs REPORT` prices the replays with the verify costs an earlier run of this script or of edit_replay.py
timed (no model timed); `--tile N` replays with that tile (1: every width weighed).

    .venv/bin/python benchmarks/copy_replay.py --out benchmarks/results/copy-replay.json
    .venv/bin/python benchmarks/copy_replay.py --long --texts benchmarks/results/copy-replay-long-texts.json \
        --out benchmarks/results/copy-replay-long.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from statistics import geometric_mean

from drafters_speed import VerifyCosts, token_ids, verify_costs

from diversed.backends.llama_cpp import LlamaCppModel
from diversed.decoding.drafters import base
from diversed.decoding.drafters import prediction as predicted
from diversed.decoding.drafters.base import Acceptance, best_candidate
from diversed.decoding.drafters.lookup import LookupDrafter
from diversed.decoding.drafters.prediction import PredictionDrafter
from diversed.decoding.drafters.suffix import SuffixCache, SuffixDrafter
from diversed.decoding.engine import decode
from diversed.decoding.schedule import SpeedModel
from diversed.decoding.scheduler import copy_width
from diversed.models.loading import load_pair
from diversed.request import DEFAULT_DRAFTING, Sampling, Verification
from diversed.tasks import get_task

Prior = tuple[float, float]  # (kept, rejected) pseudo-counts

# (kept, rejected) pseudo-counts per kind of proposal; (1, 1) was the default before this replay.
PRIORS = [(1.0, 1.0), (1.0, 2.0), (1.0, 3.0), (0.5, 1.5), (2.0, 4.0), (1.0, 5.0)]
RUN_PRIORS = [(1.0, 5.0), (1.0, 1.0), (4.0, 1.0), (16.0, 1.0), (64.0, 1.0)]
PREDICTION_PRIORS = [(1.0, 5.0), (1.0, 3.0), (1.0, 1.0), (4.0, 1.0), (16.0, 1.0)]
WORKLOADS = {"mbpp-edit": 6, "mbpp-edit-2turn": 4, "gsm8k": 4, "mbpp": 4}
LONG_WORKLOADS = {"humaneval": 6, "file-edit": 6}
FLOOR = 0.99  # --long: the least replayed speedup over plain a candidate may have on any workload
ROUNDS = 4  # --long: rounds of the alternation at most


def replay(prompt: list[int], text: list[int], costs: VerifyCosts, prior: tuple[float, float] = base.PRIOR,
           prediction: list[int] | None = None, told_breaks: bool = False,
           memory: dict[int, list[float]] | None = None, rounds: list[tuple[int, int, int, str]] | None = None,
           tile: int = LlamaCppModel.pass_tile, run_prior: tuple[float, float] = base.RUN_PRIOR,
           prediction_prior: tuple[float, float] = predicted.PRIOR,
           prediction_run_prior: tuple[float, float] = predicted.RUN_PRIOR) -> float:
    """Seconds of decode passes the copying drafters would spend writing `text` after `prompt` (with a
    prediction, the prediction drafter first, as the auto drafter takes them). told_breaks: each round's width
    is cut to the tokens that will be kept (no drafter can know this; it separates the cost of drafts lost at
    the edits from that of widths chosen under uncertainty).

    A pass costs `costs.seconds` at its width and at the context it runs at (the prompt and what is written
    so far). The speed model knows every timed width's cost at that context, unless `memory` is given: then it
    learns them as the engine does, starting from the widths remembered there (as CostMemory starts a call:
    each weighing one, the target alone's step timed afresh), timing each round's pass, and leaves what it
    learned in `memory` for the next text. `tile`: the speed model's (SpeedModel), llama.cpp's pass_tile
    unless told otherwise. `rounds`, if given, gets each round's (context, drafts, kept,
    drafter) appended, the drafter's name "" where nothing was proposed. The copying drafters start from
    `prior` and `run_prior` (Acceptance), the prediction drafter from `prediction_prior` and
    `prediction_run_prior`."""
    drafters = [LookupDrafter(), SuffixDrafter(SuffixCache())]
    if prediction is not None:
        drafters.insert(0, PredictionDrafter(prediction_prior, prediction_run_prior))
    longest = DEFAULT_DRAFTING["llama.cpp"].maximum
    speed = SpeedModel(longest, tile=tile)
    if memory is not None:
        speed.width = {k: [1.0, total / weight] for k, (weight, total) in memory.items() if k != 1}
    for drafter in drafters:
        if not isinstance(drafter, PredictionDrafter):
            drafter.acceptance = Acceptance(prior, run_prior)
        drafter.add(prompt, prediction)
    seconds, i = 0.0, 0
    while i < len(text):
        context = len(prompt) + i
        if memory is None:  # told this context's costs: a fresh model each round (copying reads no other state)
            speed = SpeedModel(longest, tile=tile)
            speed.width = {k: [1.0, costs.at(k, context)] for k in costs.widths}
        caps = [min(longest, len(text) - i - 1)]
        options = [drafter.candidates(caps)[0] for drafter in drafters]
        chosen = best_candidate(options, caps[0])
        best = options[chosen]
        width = copy_width([best], speed)[0] if caps[0] else 0
        kept = 0
        while kept < width and best.tokens[kept] == text[i + kept]:
            kept += 1
        width = kept if told_breaks else width
        if rounds is not None:
            rounds.append((context, width, kept, drafters[chosen].name if best is not None else ""))
        emitted = text[i:i + kept + 1]
        seconds += (cost := costs.seconds(width + 1, context))
        if memory is not None:
            speed.observe_copied(width + 1, cost)
        for drafter in drafters:
            drafter.advance([emitted])
        i += len(emitted)
    if memory is not None:
        memory.clear()
        memory.update(speed.width)
    return seconds


def plain_seconds(prompt: list[int], text: list[int], costs: VerifyCosts) -> float:
    """Seconds of the target alone writing `text` after `prompt`, a pass of one token at each context."""
    return sum(costs.at(1, len(prompt) + i) for i in range(len(text)))


def greedy_texts(pair, workloads: dict[str, int], tokens: int, long_tokens: int) -> dict[str, list]:
    """(prompt ids, the target's greedy answer, the prediction or None) per workload's train prompts."""
    texts = {}
    for name, size in workloads.items():
        texts[name] = []
        for example in get_task(name).examples("train", limit=size):
            ids = token_ids(pair, example.prompt_for(chat=True))
            original = example.metadata.get("original")
            out = decode(pair.target, [ids], verification=Verification("plain"), sampling=Sampling(0.0),
                         max_new_tokens=long_tokens if original else tokens, eos_token_ids=pair.eos_token_ids)
            prediction = pair.tokenizer(original, add_special_tokens=False)["input_ids"] if original else None
            texts[name].append((ids, out.tokens[0], prediction))
    return texts


def speedup_table(runs: dict[str, list], timed: VerifyCosts, settings: dict[str, dict[str, tuple[float, float]]],
                  tile: int) -> dict[str, dict[str, float]]:
    """Each setting's speedup per workload (plain decode time over replayed, pooled), printed as a table. A
    setting is named priors for the replays (prior, run_prior, prediction_prior, prediction_run_prior),
    under its label."""
    print("| prior (kept, rejected) | " + " | ".join(runs) + " | worst | geometric mean |")
    print("|---" * (len(runs) + 3) + "|")
    table = {}
    plain = {name: sum(plain_seconds(ids, text, timed) for ids, text, _ in items) for name, items in runs.items()}
    for label, priors in settings.items():
        speedups = {name: plain[name] / sum(replay(ids, text, timed, prediction=prediction, tile=tile, **priors)
                                            for ids, text, prediction in items) for name, items in runs.items()}
        table[label] = speedups
        print(f"| {label} | " + " | ".join(f"{s:.3f}x" for s in speedups.values())
              + f" | {min(speedups.values()):.3f}x | {geometric_mean(speedups.values()):.3f}x |", flush=True)
    return table


def optimism(candidate: Prior | tuple[Prior, Prior]) -> float:
    """A candidate's prior rate of kept proposals (summed over a pair of priors): ties go to the lowest."""
    priors = candidate if isinstance(candidate[0], tuple) else (candidate,)
    return sum(kept / (kept + rejected) for kept, rejected in priors)


def choose(table: dict[str, dict[str, float]], candidates: list, long: bool):
    """The rule of the module's docstring. Without `long`: the best worst-workload speedup (to 3 decimals). With
    it: among the candidates at FLOOR or above on every workload (all, if none is), the best geometric mean
    (to 3 decimals). Ties go to the more pessimistic candidate (lower prior rate)."""
    def worst(c) -> float:
        return round(min(table[str(c)].values()), 3)

    if not long:
        return max(candidates, key=lambda c: (worst(c), -optimism(c)))
    eligible = [c for c in candidates if worst(c) >= FLOOR] or candidates
    return max(eligible, key=lambda c: (round(geometric_mean(table[str(c)].values()), 3), -optimism(c)))


def choose_long(runs: dict[str, list], timed: VerifyCosts, tile: int) -> dict:
    """`--long`'s alternation (the module's docstring): the rounds' tables and choices, the last choice."""
    run_prior, prediction_priors = base.RUN_PRIOR, (predicted.PRIOR, predicted.RUN_PRIOR)
    only = {"file-edit+prediction": runs["file-edit+prediction"]}
    pairs = [(p, r) for p in PREDICTION_PRIORS for r in RUN_PRIORS]
    rounds = []
    for number in range(1, ROUNDS + 1):
        print(f"\nround {number}, (A) base.RUN_PRIOR; a prediction's (PRIOR, RUN_PRIOR) at {prediction_priors}:")
        settings = {str(r): {"run_prior": r, "prediction_prior": prediction_priors[0],
                             "prediction_run_prior": prediction_priors[1]} for r in RUN_PRIORS}
        table_a = speedup_table(runs, timed, settings, tile)
        chosen_run = choose(table_a, RUN_PRIORS, True)
        print(f"\nround {number}, (B) a prediction's (PRIOR, RUN_PRIOR); base.RUN_PRIOR at {chosen_run}:")
        settings = {str(pair): {"run_prior": chosen_run, "prediction_prior": pair[0], "prediction_run_prior": pair[1]}
                    for pair in pairs}
        table_b = speedup_table(only, timed, settings, tile)
        chosen_pair = choose(table_b, pairs, True)
        print(f"round {number} chose base.RUN_PRIOR = {chosen_run}, prediction (PRIOR, RUN_PRIOR) = {chosen_pair}")
        rounds.append({"run_prior_speedups": table_a, "run_prior": chosen_run,
                       "prediction_speedups": table_b, "prediction_priors": chosen_pair})
        fixed_point = (chosen_run, chosen_pair) == (run_prior, prediction_priors)
        if fixed_point:
            break
        run_prior, prediction_priors = chosen_run, chosen_pair
    return {"rounds": rounds, "fixed_point": fixed_point,
            "run_prior": chosen_run, "prediction_prior": chosen_pair[0], "prediction_run_prior": chosen_pair[1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=192)
    parser.add_argument("--long", action="store_true",
                        help="choose the priors of long runs and a prediction's (base.RUN_PRIOR, "
                             "prediction.PRIOR and RUN_PRIOR)")
    parser.add_argument("--texts", type=Path, help="the greedy texts: read if the file exists, else made and written")
    parser.add_argument("--costs", type=Path, help="an earlier run's report: price with its timed costs")
    parser.add_argument("--tile", type=int, default=LlamaCppModel.pass_tile,
                        help="the speed model's tile in the replays (1: every width weighed)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    workloads = {**WORKLOADS, **(LONG_WORKLOADS if args.long else {})}
    texts = json.loads(args.texts.read_text()) if args.texts and args.texts.exists() else {}
    missing = {name: size for name, size in workloads.items() if name not in texts}
    # To write texts or time costs; every prompt read whole.
    pair = load_pair(backend="llama.cpp", cache_ram=0) if missing or not args.costs else None
    if missing:
        texts |= greedy_texts(pair, missing, args.tokens, 1024)
        if args.texts:
            args.texts.write_text(json.dumps(texts) + "\n")
    texts = {name: [tuple(item) for item in texts[name]] for name in workloads}
    if args.costs:
        timed = VerifyCosts.from_report(args.costs)
    else:
        timed = verify_costs(pair, texts["file-edit" if args.long else "mbpp-edit"][0][0])
    print(f"verify pass by width (ms): {timed.line()}")
    report = {"costs_ms": timed.ms(), "tile": args.tile}
    runs = {name: [(ids, text, None) for ids, text, _ in items] for name, items in texts.items()}
    if args.long:
        runs["file-edit+prediction"] = texts["file-edit"]
        report |= choose_long(runs, timed, args.tile)
        print(f"\nchosen: base.RUN_PRIOR = {report['run_prior']}, prediction.PRIOR = {report['prediction_prior']}, "
              f"prediction.RUN_PRIOR = {report['prediction_run_prior']} (fixed point: {report['fixed_point']})")
    else:
        report["speedups"] = speedup_table(runs, timed, {str(p): {"prior": p} for p in PRIORS}, args.tile)
        print(f"chosen: {(chosen := choose(report['speedups'], PRIORS, False))}")
        report["chosen"] = chosen
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()

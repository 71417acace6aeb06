"""How close the copying drafters come to the copying oracle on whole-file edits, by replay: decode time only,
no timing noise, every verify width's cost known (the speed model in the engine learns them as it goes), each
pass priced at the context it runs at (a wide pass costs about half as much again after 2,000 tokens as after
250).

The texts are the target's greedy answers to `file-edit` train prompts on llama.cpp (made once and written to
`--texts`, or read from it). Each is replayed as copy_replay.replay does (the auto drafter's copying members
and the speed model's width each round), without and with the file as the prediction, and priced as the
oracle of drafters_speed.oracle_seconds (a drafter that knows how many tokens of the best proposal will be
kept), all with the verify passes timed at the start of the run at a few contexts (`--contexts`, linear
between them). Between them, "told where it breaks": the prediction's replay with each round cut to the
drafts that will be kept, the widths otherwise the speed model's: what is left of the gap to the oracle is the
width of rounds, not the drafts lost at edits. And
"learning the costs": the prediction's replay with a speed model that knows no width's cost until it has
timed it, as in the engine (carried from text to text as the cost memory carries it): what the widths never
tried cost.

`--real`: each text is also written by the engine itself (`decode`, the file as prediction, the cost memory of
this machine as a user has it), timing every pass of the target: its decode time (after the prompt pass,
loop included) as a speedup over the replayed plain time, and its passes' seconds against what the timed
costs price them at (the same widths at the same contexts): what the replay leaves out.

`--all-widths` times every width from 1 to 65 tokens (slower), so that every replayed pass is priced at its
own width's cost, not between timed ones: a pass over a multiple of 16 tokens costs less than one a few tokens
wider (llama.cpp's pass_tile). `--tile N` replays, and runs the engine, with that tile (1: every width weighed,
as before the tile).

`--costs REPORT` prices the replays with the verify costs an earlier run timed (its `--out`), so that a
replay repeats exactly, with no model timed; `--rounds` then breaks the prediction's replay down by round: the
rounds that kept every draft, those that broke (a draft rejected) and those that drafted nothing, by drafter,
with their seconds and, for the broken ones, what they would have cost cut at the break.

    .venv/bin/python benchmarks/edit_replay.py --texts benchmarks/results/edit-replay-texts.json \
        --out benchmarks/results/edit-replay.json
    .venv/bin/python benchmarks/edit_replay.py --texts benchmarks/results/edit-replay-texts.json \
        --costs benchmarks/results/edit-replay-epyc.json --rounds
    .venv/bin/python benchmarks/edit_replay.py --texts benchmarks/results/edit-replay-texts.json --all-widths \
        --real --out benchmarks/results/edit-replay-tiles-epyc.json
    .venv/bin/python benchmarks/edit_replay.py --texts benchmarks/results/edit-replay-texts.json --tile 1 \
        --costs benchmarks/results/edit-replay-tiles-epyc.json --real \
        --out benchmarks/results/edit-replay-no-tile-epyc.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from copy_replay import plain_seconds, replay
from drafters_speed import VerifyCosts, oracle_seconds, token_ids, verify_costs

from diversed.backends.llama_cpp import LlamaCppModel
from diversed.decoding.drafters import SuffixCache, base
from diversed.decoding.engine import decode
from diversed.machine import describe
from diversed.models.loading import load_pair
from diversed.request import DEFAULT_DRAFTING, Sampling, Verification
from diversed.tasks import get_task


class TimedModel:
    """A backend model whose rows log each feed: (context held, tokens fed per row, seconds)."""

    def __init__(self, model, log: list[tuple[int, int, float]]) -> None:
        self.model, self.log = model, log

    def rows(self, *args, **kwargs):
        return TimedRows(self.model.rows(*args, **kwargs), self.log)

    def __getattr__(self, name: str):
        return getattr(self.model, name)


class TimedRows:
    def __init__(self, rows, log: list[tuple[int, int, float]]) -> None:
        self.inner, self.log = rows, log

    def feed(self, tokens, outputs, hidden=False):
        context, start = self.inner.lengths[0], time.perf_counter()
        out = self.inner.feed(tokens, outputs, hidden)
        self.log.append((context, len(tokens[0]), time.perf_counter() - start))
        return out

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


def greedy_answer(target, pair, ids: list[int], prediction: list[int]) -> list[int]:
    """The engine's greedy answer with the file as prediction and the default drafting (`target`: the pair's,
    or a TimedModel of it)."""
    out = decode(target, [ids], drafter="auto", verification=Verification("exact"), sampling=Sampling(0.0),
                 drafting=DEFAULT_DRAFTING["llama.cpp"], max_new_tokens=1024, eos_token_ids=pair.eos_token_ids,
                 predictions=[prediction])
    return out.tokens[0]


def real_decode(pair, ids: list[int], prediction: list[int], timed) -> dict:
    """The engine writing one answer with the prediction: its tokens, decode seconds after the prompt pass, and
    its passes' seconds and the timed costs' price for them."""
    log: list[tuple[int, int, float]] = []
    start = time.perf_counter()
    tokens = greedy_answer(TimedModel(pair.target, log), pair, ids, prediction)
    passes = log[1:]  # the first feed is the prompt pass
    return {"tokens": tokens, "decode": time.perf_counter() - start - log[0][2],
            "passes": sum(s for _, _, s in passes), "priced": sum(timed.seconds(k, c) for c, k, _ in passes)}


def round_breakdown(rounds: list[tuple[int, int, int, str]], costs: VerifyCosts) -> str:
    """A table of replayed rounds ((context, drafts, kept, drafter) each) by outcome and drafter: rounds,
    tokens written, seconds, and seconds had each round been cut at its break (what a drafter that knew
    where the copy breaks would pay)."""
    groups: dict[tuple[str, str], list[float]] = {}
    for context, drafts, kept, drafter in rounds:
        outcome = "none drafted" if drafts == 0 else "all kept" if kept == drafts else "broke"
        group = groups.setdefault((outcome, drafter or "-"), [0, 0, 0.0, 0.0])
        group[0] += 1
        group[1] += kept + 1
        group[2] += costs.seconds(drafts + 1, context)
        group[3] += costs.seconds(kept + 1, context)
    lines = ["| rounds | drafter | count | tokens written | seconds | cut at the break |", "|---|---|---|---|---|---|"]
    lines += [f"| {outcome} | {drafter} | {n} | {tokens} | {seconds:.2f} | {cut:.2f} |"
              for (outcome, drafter), (n, tokens, seconds, cut) in sorted(groups.items())]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=8, help="file-edit train prompts")
    parser.add_argument("--texts", type=Path, help="the greedy texts: read if the file exists, else made and written")
    parser.add_argument("--contexts", type=int, nargs="+", default=[256, 1024, 2048],
                        help="contexts (tokens held) at which the verify passes are timed")
    parser.add_argument("--real", action="store_true", help="also time the engine writing each text")
    parser.add_argument("--all-widths", action="store_true", help="time every width from 1 to 65 tokens")
    parser.add_argument("--tile", type=int, default=LlamaCppModel.pass_tile,
                        help="the speed model's tile in the replays and the engine (1: every width weighed)")
    parser.add_argument("--costs", type=Path, help="an earlier run's report: price with its timed costs")
    parser.add_argument("--rounds", action="store_true", help="break the prediction's replay down by round")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    # The pair is loaded only to write texts, time costs or run the engine.
    made = args.texts and args.texts.exists()
    pair = None if made and args.costs and not args.real else load_pair(backend="llama.cpp", cache_ram=0)
    if pair is not None:
        pair.target.pass_tile = args.tile  # the engine's speed model weighs widths as the replays' does
    if made:
        texts = json.loads(args.texts.read_text())
    else:
        texts = []
        for example in get_task("file-edit").examples("train", limit=args.prompts):
            ids = token_ids(pair, example.prompt_for(chat=True))
            prediction = pair.tokenizer(example.metadata["original"], add_special_tokens=False)["input_ids"]
            texts.append((example.id, ids, greedy_answer(pair.target, pair, ids, prediction), prediction))
        if args.texts:
            args.texts.write_text(json.dumps(texts) + "\n")
    if args.costs:
        timed = VerifyCosts.from_report(args.costs)
        machine = f"{json.loads(args.costs.read_text())['machine']} (the costs of {args.costs.name})"
    else:
        timed = verify_costs(pair, texts[0][1], contexts=tuple(args.contexts),  # for every replay alike
                             **({"widths": list(range(1, 66))} if args.all_widths else {}))
        machine = describe()
    print(f"{machine}\nverify pass by context and width (ms): {timed.line()}")
    report = {"machine": machine, "tile": args.tile, "costs_ms": timed.ms(), "texts": []}
    columns = ("copying", "prediction", "learning", "told", "oracle", *(("real",) if args.real else ()))
    totals = dict.fromkeys(("plain", *columns, "passes", "priced"), 0.0)
    print("| prompt | tokens | copying | with the prediction | learning the costs | told where it breaks | oracle |"
          + (" the engine | its passes vs their price |" if args.real else "")
          + "\n|---|---|---|---|---|---|---|" + ("---|---|" if args.real else ""))
    memory: dict[int, list[float]] = {}
    rounds: list[tuple[int, int, int, str]] = []
    for name, ids, text, prediction in texts:
        if args.real:
            real = real_decode(pair, ids, prediction, timed)
            if real["tokens"] != text:  # a near-tie turned by a pass's width: replay what the engine wrote
                print(f"{name}: the engine wrote {len(real['tokens'])} tokens, not the {len(text)} of --texts")
                text = real["tokens"]
        tile = args.tile
        seconds = {"plain": plain_seconds(ids, text, timed),
                   "copying": replay(ids, text, timed, base.PRIOR, tile=tile),
                   "prediction": replay(ids, text, timed, base.PRIOR, prediction, rounds=rounds, tile=tile),
                   "learning": replay(ids, text, timed, base.PRIOR, prediction, memory=memory, tile=tile),
                   "told": replay(ids, text, timed, base.PRIOR, prediction, told_breaks=True, tile=tile),
                   "oracle": timed.at(1, len(ids)) + oracle_seconds(ids, text, timed, SuffixCache(), prediction)}
        if args.real:
            seconds |= {"real": real["decode"], "passes": real["passes"], "priced": real["priced"]}
        report["texts"].append({"id": name, "tokens": len(text), "seconds": seconds})
        for key, value in seconds.items():
            totals[key] += value
        print(f"| {name} | {len(text)} | " + " | ".join(f"{seconds['plain'] / seconds[k]:.2f}x" for k in columns)
              + (f" | {seconds['passes'] / seconds['priced']:.2f} |" if args.real else " |"))
    report["speedups"] = {k: totals["plain"] / totals[k] for k in columns}
    print("| all | | " + " | ".join(f"{report['speedups'][k]:.2f}x" for k in columns)
          + (f" | {totals['passes'] / totals['priced']:.2f} |" if args.real else " |"))
    if args.rounds:
        print(round_breakdown(rounds, timed))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()

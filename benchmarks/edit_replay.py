"""How close the copying drafters come to the copying oracle on whole-file edits, by replay: decode time only,
no timing noise, every verify width's cost known (the speed model in the engine learns them as it goes).

The texts are the target's greedy answers to `file-edit` train prompts on llama.cpp (made once and written to
`--texts`, or read from it). Each is replayed as copy_replay.replay does (the auto drafter's copying members
and the speed model's width each round), without and with the file as the prediction, and priced as the
oracle of drafters_speed.oracle_seconds (a drafter that knows how many tokens of the best proposal will be
kept), all with the verify passes timed at the start of the run. Between them, "told where it breaks": the
prediction's replay with each round cut to the drafts that will be kept, the widths otherwise the speed
model's: what is left of the gap to the oracle is the width of rounds, not the drafts lost at edits. And
"learning the costs": the prediction's replay with a speed model that knows no width's cost until it has
timed it, as in the engine (carried from text to text as the cost memory carries it): what the widths never
tried cost.

    .venv/bin/python benchmarks/edit_replay.py --texts benchmarks/results/edit-replay-texts.json \
        --out benchmarks/results/edit-replay.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from copy_replay import replay
from drafters_speed import oracle_seconds, token_ids, verify_costs
from machine import describe

from diversed.decoding.drafters import SuffixCache, base
from diversed.decoding.engine import decode
from diversed.models.loading import load_pair
from diversed.request import DEFAULT_DRAFTING, Sampling, Verification
from diversed.tasks import get_task


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=8, help="file-edit train prompts")
    parser.add_argument("--texts", type=Path, help="the greedy texts: read if the file exists, else made and written")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    pair = load_pair(backend="llama.cpp")
    if args.texts and args.texts.exists():
        texts = json.loads(args.texts.read_text())
    else:
        texts = []
        for example in get_task("file-edit").examples("train", limit=args.prompts):
            ids = token_ids(pair, example.prompt_for(chat=True))
            prediction = pair.tokenizer(example.metadata["original"], add_special_tokens=False)["input_ids"]
            out = decode(pair.target, [ids], drafter="auto", verification=Verification("exact"),
                         sampling=Sampling(0.0), draft_length=DEFAULT_DRAFTING["llama.cpp"], max_new_tokens=1024,
                         eos_token_ids=pair.eos_token_ids, predictions=[prediction])
            texts.append((example.id, ids, out.tokens[0], prediction))
        if args.texts:
            args.texts.write_text(json.dumps(texts) + "\n")
    timed = verify_costs(pair, texts[0][1])  # at the first prompt's context, for every replay alike
    costs = timed.flat()
    print(f"verify pass by width (ms): {timed.line()}")
    report = {"machine": describe(), "costs_ms": timed.ms(), "texts": []}
    columns = ("copying", "prediction", "learning", "told", "oracle")
    totals = dict.fromkeys(("plain", *columns), 0.0)
    print("| prompt | tokens | copying | with the prediction | learning the costs | told where it breaks | oracle |"
          "\n|---|---|---|---|---|---|---|")
    memory: dict[int, list[float]] = {}
    for name, ids, text, prediction in texts:
        seconds = {"plain": len(text) * costs[1], "copying": replay(ids, text, costs, base.PRIOR),
                   "prediction": replay(ids, text, costs, base.PRIOR, prediction),
                   "learning": replay(ids, text, costs, base.PRIOR, prediction, memory=memory),
                   "told": replay(ids, text, costs, base.PRIOR, prediction, told_breaks=True),
                   "oracle": costs[1] + oracle_seconds(ids, text, timed, SuffixCache(), prediction)}
        report["texts"].append({"id": name, "tokens": len(text), "seconds": seconds})
        for key, value in seconds.items():
            totals[key] += value
        print(f"| {name} | {len(text)} | " + " | ".join(f"{seconds['plain'] / seconds[k]:.2f}x" for k in columns)
              + " |")
    report["speedups"] = {k: totals["plain"] / v for k, v in totals.items()}
    print("| all | | " + " | ".join(f"{report['speedups'][k]:.2f}x" for k in columns) + " |")
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()

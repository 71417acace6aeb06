"""Where trained DIVERSED heads are strict and where they are lenient: their w by kind of token and by how much
the models disagree, on completions of held-out prompts (benchmarks/head_weights.py).

The completions are those of one verification of a finished evaluation (default: exact, i.e. the target's
own distribution), so every head is read on the same text; without --results, held-out prompts are completed
here with exact. Writes head_weights.{md,json,png} into --out.

    .venv/bin/python benchmarks/head_tokens.py --task gsm8k --results benchmarks/results/gsm8k-t0.1 \\
        --head lambda0.03=benchmarks/results/train-gsm8k-lambda0.03/checkpoint --limit 40 \\
        --out benchmarks/results/gsm8k-t0.1/head-weights
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from head_weights import token_weights, write_weights_report

from diversed.admission import load_head
from diversed.evaluation.run import CONFIG_FILE, RESULTS_FILE, load_done_rows
from diversed.generation import generate
from diversed.models.loading import load_pair
from diversed.tasks import get_task


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--head", action="append", default=[], metavar="NAME=DIR",
                        help="a head to read (repeat for several; default: the packaged one)")
    parser.add_argument("--task", default="gsm8k")
    parser.add_argument("--results", help="an evaluation folder whose completions to read")
    # --method: the flag's name before this release, in the commands that results' READMEs record.
    parser.add_argument("--verification", "--method", default="exact", help="whose completions in --results")
    parser.add_argument("--limit", type=int, default=40, help="completions (the first ones of the test split)")
    parser.add_argument("--temperature", type=float, help="for TV(q, p) (default: the evaluation's, else 1)")
    parser.add_argument("--max-new-tokens", type=int, default=512, help="when completing here")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    heads = dict(h.split("=", 1) if "=" in h else (Path(h).name, h) for h in args.head) or {"packaged": None}
    task = get_task(args.task)
    examples = {e.id: e for e in task.examples("test", limit=args.limit if not args.results else None)}
    temperature = args.temperature
    if args.results:
        config = json.loads((Path(args.results) / CONFIG_FILE).read_text())
        if config["task"] != task.name:
            parser.error(f"{args.results} is an evaluation of {config['task']}, not {task.name}")
        temperature = config["temperature"] if temperature is None else temperature
        rows = load_done_rows(Path(args.results) / RESULTS_FILE)  # older runs' rows as today's
        rows = sorted((r for r in rows if r["verification"] == args.verification),
                      key=lambda r: r["index"])[:args.limit]
        if not rows:
            parser.error(f"{args.results} has no completions of verification {args.verification!r}")
        prompts, completions = [examples[r["example"]].prompt for r in rows], [r["text"] for r in rows]
        source = f"{len(rows)} completions by {args.verification} from {args.results}"
    temperature = 1.0 if temperature is None else temperature

    pair = load_pair()
    loaded = {name: load_head(pair, directory) for name, directory in heads.items()}
    if not args.results:
        prompts = [e.prompt for e in examples.values()]
        completions = [c.text for c in generate(pair, prompts, verification="exact", temperature=temperature,
                                                 max_new_tokens=args.max_new_tokens, stop=task.stop)]
        source = f"{len(prompts)} completions by exact, sampled here"
    weights = token_weights(pair, loaded, prompts, completions, temperature=temperature,
                            code=task.metric == "pass@1", progress=True)
    header = (f"# Head weights on {task.name} (test), {source}; TV(q, p) at T = {temperature}, "
              f"{len(weights.text)} tokens; heads: " + ", ".join(f"{n} = {d or 'packaged'}" for n, d in heads.items()))
    write_weights_report(weights, args.out, header)
    print((Path(args.out) / "head_weights.md").read_text())


if __name__ == "__main__":
    main()

"""Where relaxed verification loses its answers: the problems of a finished evaluation grouped by how many runs
of the target's own distribution solved them, and each method's accuracy in each group (95% Wilson intervals).

A method that loses only on problems the target itself solves by luck (1 of 2 reference runs right) costs
little; one that loses on problems the target always solves (2 of 2) changes answers the target is sure of.
The reference methods score 100% and 0% in the extreme groups by construction (they define them): a third run
of the target would score a little under 100% in the first, so compare the other methods with that in mind.

    .venv/bin/python benchmarks/where_lost.py benchmarks/results/gsm8k-t0.1 --reference auto,exact
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

from scipy.stats import binomtest

from diversed.evaluation.run import RESULTS_FILE


def rewards_by_method(folder: Path) -> dict[str, dict[str, float]]:
    """{method: {example id: reward}} from an evaluation folder's results.jsonl."""
    rewards: dict[str, dict[str, float]] = defaultdict(dict)
    with open(folder / RESULTS_FILE) as lines:
        for line in lines:
            row = json.loads(line)
            rewards[row["method"]][row["example"]] = row["reward"]
    return dict(rewards)


def accuracy_by_group(rewards: dict[str, dict[str, float]], reference: list[str]) -> list[dict]:
    """One row per group (problems solved by k of the reference methods, k from all down to 0): its size and each
    method's accuracy with a 95% Wilson interval, on the problems every method finished."""
    missing = [m for m in reference if m not in rewards]
    if missing:
        raise ValueError(f"reference methods not in the results: {', '.join(missing)} (have: {', '.join(rewards)})")
    shared = sorted(set.intersection(*(set(r) for r in rewards.values())))
    groups = []
    for k in range(len(reference), -1, -1):
        problems = [e for e in shared if sum(rewards[m][e] == 1 for m in reference) == k]
        row = {"solved_by": f"{k} of {len(reference)}", "problems": len(problems)}
        for method, by_example in rewards.items():
            right = sum(by_example[e] == 1 for e in problems)
            ci = binomtest(right, len(problems)).proportion_ci(0.95, method="wilson") if problems else None
            row[method] = (right / len(problems), ci.low, ci.high) if problems else None
        groups.append(row)
    return groups


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path, help="an evaluation folder (with results.jsonl)")
    parser.add_argument("--reference", default="auto,exact",
                        help="comma-separated methods that sample the target's own distribution")
    parser.add_argument("--methods", help="comma-separated methods to show (default: all; the problems are those "
                                          "every shown method finished)")
    args = parser.parse_args()
    rewards = rewards_by_method(args.folder)
    if args.methods:
        unknown = [m for m in args.methods.split(",") if m not in rewards]
        if unknown:
            parser.error(f"not in the results: {', '.join(unknown)}")
        rewards = {m: rewards[m] for m in dict.fromkeys(args.reference.split(",") + args.methods.split(","))}
    groups = accuracy_by_group(rewards, args.reference.split(","))
    headers = [f"solved by {g['solved_by']} ({g['problems']} problems)" for g in groups]
    print(f"| method | {' | '.join(headers)} |")
    print("|---" * (len(groups) + 1) + "|")
    for method in rewards:
        print(f"| {method} | {' | '.join(_percent(g[method]) for g in groups)} |")


def _percent(accuracy: tuple[float, float, float] | None) -> str:
    if accuracy is None:
        return "-"
    mean, low, high = accuracy
    return f"{100 * mean:.0f}% ({100 * low:.0f}-{100 * high:.0f})"


if __name__ == "__main__":
    main()

"""Where relaxed verification loses its answers: the problems of a finished evaluation grouped by how many runs
of the target's own distribution solved them, and each verification's accuracy in each group, with 95%
intervals (quality_by_reference_agreement).

A verification that loses only on problems the target itself solves by luck (1 of 2 reference runs right)
costs little; one that loses on problems the target always solves (2 of 2) changes answers the target is sure
of. The reference verifications score 100% and 0% in the outer groups by construction (they define them): a
third run of the target would score a little under 100% in the first, so compare the others with that in mind.

    .venv/bin/python benchmarks/where_lost.py benchmarks/results/gsm8k-t0.1 --reference plain,exact \\
        --verifications static:0.8,static:0.4
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from diversed.evaluation.report import mean_interval
from diversed.evaluation.run import RESULTS_FILE, load_done_rows


def quality_by_reference_agreement(rows: Sequence[dict], verifications: Sequence[str],
                                   reference: Sequence[str]) -> list[dict]:
    """Where a verification loses its quality: the examples grouped by how many of the reference verifications
    (runs of the target's own distribution, e.g. plain and exact) got reward 1 on them, from all down to none,
    and each verification's mean reward in each group with a 95% interval (mean_interval), on the examples that
    every verification and every reference ran. One dict per group: solved_by (k), examples, and
    {verification: (mean, low, high) or None}.
    The references score 1 and 0 in the outer groups by construction, as they define them."""
    by_verification = {m: {r["example"]: r["reward"] for r in rows if r["verification"] == m} for m in dict.fromkeys(
        [*reference, *verifications])}
    missing = [m for m, rewards in by_verification.items() if not rewards]
    if missing:
        raise ValueError(f"no results for: {', '.join(missing)}")
    shared = sorted(set.intersection(*(set(rewards) for rewards in by_verification.values())))
    groups = []
    for k in range(len(reference), -1, -1):
        examples = [e for e in shared if sum(by_verification[m][e] == 1 for m in reference) == k]
        quality = {}
        for verification in verifications:
            rewards = [by_verification[verification][e] for e in examples]
            quality[verification] = (sum(rewards) / len(rewards), *mean_interval(rewards)) if rewards else None
        groups.append({"solved_by": k, "examples": len(examples), "quality": quality})
    return groups


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path, help="an evaluation folder (with results.jsonl)")
    parser.add_argument("--reference", default="plain,exact",
                        help="comma-separated verifications that sample the target's own distribution")
    # --methods: the flag's name before this release, in the commands that results' READMEs record.
    parser.add_argument("--verifications", "--methods",
                        help="comma-separated verifications to show (default: all in the results); the problems "
                             "are those every shown and reference verification finished")
    args = parser.parse_args()
    rows = load_done_rows(args.folder / RESULTS_FILE)  # a run in progress may end in a row cut short
    reference = args.reference.split(",")
    verifications = (args.verifications.split(",") if args.verifications else
                     list(dict.fromkeys(r["verification"] for r in rows)))
    groups = quality_by_reference_agreement(rows, verifications, reference)
    headers = [f"solved by {g['solved_by']} of {len(reference)} ({g['examples']} problems)" for g in groups]
    print(f"| method | {' | '.join(headers)} |")  # as `diversed report` heads the column
    print("|---" * (len(groups) + 1) + "|")
    for verification in verifications:
        print(f"| {verification} | {' | '.join(_percent(g['quality'][verification]) for g in groups)} |")


def _percent(quality: tuple[float, float, float] | None) -> str:
    if quality is None:
        return "-"
    mean, low, high = quality
    return f"{100 * mean:.0f}% ({100 * low:.0f}-{100 * high:.0f})"


if __name__ == "__main__":
    main()

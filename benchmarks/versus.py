"""Two verifications of a finished (or running) evaluation against each other, paired on the problems both
finished: the difference in quality and the ratio of rejection rates, each with its 95% bootstrap interval over
problems (diversed.evaluation.report.compare), and both acceptance rates. For a question the summary's
columns (each verification against plain, exact and the static curve) do not ask, such as a head against
lenience at about the same acceptance.

    .venv/bin/python benchmarks/versus.py benchmarks/results/gsm8k-t0.1 diversed:gsm8k@+3 lossy:0.99
"""

from __future__ import annotations

import argparse
from pathlib import Path

from diversed.evaluation.report import compare, format_difference, format_ratio
from diversed.evaluation.run import RESULTS_FILE, load_done_rows, parse_verifications


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path, help="an evaluation folder (with results.jsonl)")
    parser.add_argument("verification", help="the verification compared")
    parser.add_argument("other", help="the verification it is compared with")
    args = parser.parse_args()
    verification, other = parse_verifications([args.verification, args.other], heads=False)
    rows = load_done_rows(args.folder / RESULTS_FILE)  # a run in progress may end in a row cut short
    result = compare(rows, verification, other)
    acceptance = result["acceptance"]
    print(f"{verification} against {other}, paired on the {result['examples']} problems both finished:\n")
    print("| quality difference, points (95% CI) | rejections, ratio (95% CI) | acceptance | acceptance of the other |")
    print("|---|---|---|---|")
    print(f"| {format_difference(result['quality_difference'])} | {format_ratio(result['rejection_ratio'])} | "
          + " | ".join("-" if acceptance[m] is None else f"{acceptance[m]:.1%}" for m in (verification, other))
          + " |")


if __name__ == "__main__":
    main()

"""Choose the test run's relaxed points from a calibration run on train problems, by a rule fixed before it.

Given an evaluation folder (diversed eval on train problems) that ran `exact` and a family's grid (lossy:L,
cactus:D, ...), prints the chosen verifications, comma-separated:
  - the family's most accepting point (ties: the later one in the grid, the more lenient);
  - `--count - 1` more, each the point whose acceptance is nearest k/count of the way from exact's acceptance
    to the most accepting one's (k = 1 .. count - 1), no point twice;
  - with `--near VERIFICATION`, instead: the one point of the family nearest VERIFICATION's acceptance.

    python benchmarks/pick_points.py benchmarks/results/gsm8k-t0.7/calibration --family lossy --count 3
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def pick(acceptance: dict[str, float], family: str, count: int, near: str | None = None) -> list[str]:
    """The chosen verifications of `family` (labels 'family:value...'), by the rule in this module's docstring."""
    grid = [m for m in acceptance if m.split(":")[0] == family]
    if not grid:
        raise SystemExit(f"no {family} verification in the calibration run")
    if near is not None:
        return [min(grid, key=lambda m: abs(acceptance[m] - acceptance[near]))]
    top = max(reversed(grid), key=lambda m: acceptance[m])  # reversed: ties go to the later, more lenient one
    chosen, low = [top], acceptance["exact"]
    for k in range(1, count):
        goal = low + k / count * (acceptance[top] - low)
        rest = [m for m in grid if m not in chosen]
        if rest:
            chosen.append(min(rest, key=lambda m: abs(acceptance[m] - goal)))
    return chosen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path)
    parser.add_argument("--family", required=True)
    parser.add_argument("--count", type=int, default=1)
    parser.add_argument("--near", help="choose the family's point nearest this verification's acceptance")
    args = parser.parse_args()
    rows = json.loads((args.folder / "summary.json").read_text())
    acceptance = {row["method"]: row["acceptance_rate"] for row in rows if row["acceptance_rate"] is not None}
    print(",".join(pick(acceptance, args.family, args.count, args.near)))


if __name__ == "__main__":
    main()

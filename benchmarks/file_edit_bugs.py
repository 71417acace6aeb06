"""Regenerate the file-edit task's planted bugs, diversed/tasks/data/file-edit/bugs.json (then its manifest's
sha256): for every unit of each split, the first mutation site whose bug the unit's own tests catch.

    .venv/bin/python benchmarks/file_edit_bugs.py > diversed/tasks/data/file-edit/bugs.json
"""

from __future__ import annotations

import argparse
import json
import sys

from diversed.tasks.file_edit import SPLITS, mutation_sites, plant, units
from diversed.tasks.rewards import code_reward


def find_bugs(split: str) -> dict[str, int]:
    """For every unit of a split: the first mutation site whose planted bug its own tests catch, where the
    unmutated code passes them (run in the sandbox); units without one are left out."""
    from tqdm import tqdm

    found = {}
    for unit in tqdm(units(split), desc=f"planting bugs ({split})"):
        if not code_reward(unit.code, unit.tests, None):
            continue
        for index, site in enumerate(mutation_sites(unit.code, unit.function)):
            if not code_reward(plant(unit.code, site), unit.tests, None, timeout_s=5):
                found[unit.id] = index
                break
    return found


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    json.dump({split: find_bugs(split) for split in SPLITS}, sys.stdout, indent=0, sort_keys=True)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()

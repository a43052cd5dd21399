"""Summarise a ``ROUNDING_REPORT`` file (tests/tolerance.py): per case, how many comparisons, the largest error /
bound (the smallest margin) and the largest bound relative to its value (the weakest power)."""

from __future__ import annotations

import json
import sys
from collections import defaultdict


def main(path: str) -> None:
    rows = [json.loads(line) for line in open(path)]
    by_case: dict[str, list[dict]] = defaultdict(list)
    for row in rows:
        by_case[row["case"][:60]].append(row)
    print(f"{'case':60s} {'n':>5s} {'max err/bound':>14s} {'worst power':>12s}")
    for case, group in sorted(by_case.items()):
        ratio = max(group, key=lambda r: r["ratio"])
        power = max(group, key=lambda r: r["power"])
        worst = f"({ratio['name']}; {power['name']})"
        print(f"{case:60s} {len(group):5d} {ratio['ratio']:14.3f} {power['power']:12.2e}  {worst}")
    print(f"all: {len(rows)} comparisons, smallest margin {1 / max(r['ratio'] for r in rows):.1f}x")


if __name__ == "__main__":
    main(sys.argv[1])

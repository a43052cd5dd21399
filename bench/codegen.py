"""Codegen speed: `regen --all` and `check` against the floor (libcst parse + print of the same upstream files).

Run: `make bench` (or `.venv/bin/python bench/codegen.py`). Prints medians of several runs and ratios to the
floor, all measured in this run on this machine.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import libcst as cst

from patchgen.config import load_config
from patchgen.project import check, load_specs, regen
from patchgen.upstream import PinnedSource

ROOT = Path(__file__).resolve().parents[1]
PATCHGEN = [sys.executable, "-m", "patchgen.cli"]


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def cli(*args: str) -> Callable[[], None]:
    return lambda: subprocess.run([*PATCHGEN, *args, "--root", str(ROOT)], check=True, capture_output=True)


def main(repeats: int = 5) -> None:
    config = load_config(ROOT)
    specs = load_specs(config, None)
    source = PinnedSource(config.pins)
    texts = [source.read(spec.module).text for spec in specs]
    lines = sum(t.count("\n") for t in texts)

    floor = median_seconds(lambda: [cst.parse_module(t).code for t in texts], repeats)
    rows = [
        ("floor: libcst parse+print", floor),
        ("regen --all (in process)", median_seconds(lambda: regen(config, specs, dry_run=True), repeats)),
        ("check --full (in process)", median_seconds(lambda: check(config, specs, full=True), repeats)),
        ("check (in process, hashes)", median_seconds(lambda: check(config, specs), repeats)),
        ("`patchgen regen --all --dry-run`", median_seconds(cli("regen", "--all", "--dry-run"), repeats)),
        ("`patchgen check`", median_seconds(cli("check"), repeats)),
    ]
    print(f"{len(specs)} specs, {len(texts)} upstream files, {lines} lines; median of {repeats} runs")
    print(f"{'job':<36} {'seconds':>8} {'x floor':>8}")
    for name, seconds in rows:
        print(f"{name:<36} {seconds:8.3f} {seconds / floor:8.2f}")


if __name__ == "__main__":
    main()

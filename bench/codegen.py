"""Codegen speed: `regen --all` and `check` against the floor (libcst parse + print of the same upstream files).

Run: `make bench` (or `.venv/bin/python bench/codegen.py [repeats]`). Every job runs alternately with the floor,
and each ratio is the median of the per-round ratios, so a machine shared with other work (CI, other builds) skews
a ratio far less than it skews the seconds. Times are CPU seconds of the process doing the work (in-process jobs:
this process; CLI jobs: the child), beside the CLI's wall-clock seconds, which is what a user waits.
Targets (docs/architecture.md): regen --all <= 1.5x the floor; `patchgen check` < 1 s wall for every spec. regen
and check pause the cyclic garbage collector while they generate (`project.without_cyclic_gc`); the floor is
measured as defined (collector on), and also with the collector paused, for a like-for-like ratio.
"""

from __future__ import annotations

import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import libcst as cst

from patchgen.config import load_config
from patchgen.project import check, load_specs, regen, without_cyclic_gc
from patchgen.upstream import PinnedSource

ROOT = Path(__file__).resolve().parents[1]
PATCHGEN = [sys.executable, "-m", "patchgen.cli"]


def cpu_seconds(fn: Callable[[], object]) -> tuple[float, float]:
    """(CPU seconds of this process and its children, wall seconds) that `fn()` took."""

    def used() -> float:
        own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime

    cpu, wall = used(), time.perf_counter()
    fn()
    return used() - cpu, time.perf_counter() - wall


def cli(*args: str) -> Callable[[], None]:
    return lambda: subprocess.run([*PATCHGEN, *args, "--root", str(ROOT)], check=True, capture_output=True)


def main(repeats: int = 5) -> None:
    config = load_config(ROOT)
    specs = load_specs(config, None)
    source = PinnedSource(config.pins)
    modules = [m for spec in specs for m in (spec.module, *(c.module for c in spec.companions))]  # companions too
    texts = [source.read(module).text for module in modules]
    lines = sum(t.count("\n") for t in texts)

    def floor() -> list[str]:
        return [cst.parse_module(text).code for text in texts]

    def floor_without_gc() -> list[str]:
        with without_cyclic_gc():  # as regen and check run (project.without_cyclic_gc)
            return floor()

    jobs = [
        ("floor, cyclic GC paused", floor_without_gc),
        ("regen --all (in process)", lambda: regen(config, specs, dry_run=True)),
        ("check --full (in process)", lambda: check(config, specs, full=True)),
        ("check (in process, hashes)", lambda: check(config, specs)),
        ("`patchgen regen --all --dry-run`", cli("regen", "--all", "--dry-run")),
        ("`patchgen check`", cli("check")),
        ("`patchgen check --full`", cli("check", "--full")),
    ]
    floor()  # warm file caches and libcst's grammar before the first timed round
    results = {name: [] for name, _ in jobs}
    floors = []
    for _ in range(repeats):
        for name, job in jobs:
            base, _ = cpu_seconds(floor)
            cpu, wall = cpu_seconds(job)
            floors.append(base)
            results[name].append((cpu, wall, cpu / base))
    print(f"{len(specs)} specs, {len(texts)} upstream files, {lines} lines; median of {repeats} rounds")
    print(f"{'job':<36} {'cpu s':>7} {'wall s':>7} {'x floor':>8}")
    print(f"{'floor: libcst parse+print':<36} {statistics.median(floors):7.3f} {'':>7} {1.0:8.2f}")
    for name, rows in results.items():
        cpu, wall, ratio = (statistics.median(column) for column in zip(*rows, strict=True))
        print(f"{name:<36} {cpu:7.3f} {wall:7.3f} {ratio:8.2f}")
    paused = statistics.median(row[0] for row in results["floor, cyclic GC paused"])
    regen_cpu = statistics.median(row[0] for row in results["regen --all (in process)"])
    print(f"regen --all / floor with the GC paused too: {regen_cpu / paused:.2f}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 5)

"""Codegen speed: `regen --all` and `check --full` against the floor (libcst parse + print of the same upstream files).

Run: `make bench` (or `.venv/bin/python bench/codegen.py [--repeats 7]`). Timed on the shared clock
(`runtime.kernels.timing`): user CPU seconds of this process, the cyclic garbage collector paused while a sample
runs except for the floor as defined (collector on, after a full collection). The work runs spec by spec: for each
spec the floor of its upstream files, the same floor with the collector paused, its regen (dry run) and its
`check --full` run back to back, the order reversed every round; a job's figure is the sum over the specs of its
fastest round per spec (the whole project: regen --all minus the orphan scan), so no job is charged for a moment
when the shared machine was slow or for the state an earlier job left behind. The `patchgen check` CLI is timed
in wall seconds, what a user waits (median of 5).
Targets (docs/architecture.md): regen --all <= 1.5x the floor; `patchgen check` < 1 s wall for every spec. regen
and check pause the cyclic garbage collector while they generate (`project.without_cyclic_gc`); the floor is
measured as defined (collector on), and also with the collector paused, for a like-for-like ratio.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import libcst as cst

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python bench/codegen.py` from the repository root

from patchgen.config import load_config  # noqa: E402
from patchgen.project import check_spec, regen, without_cyclic_gc  # noqa: E402
from patchgen.spec_set import load_specs  # noqa: E402
from patchgen.upstream import PinnedSource  # noqa: E402
from runtime.kernels.timing import Clock, fastest, interleaved  # noqa: E402  (no torch import: a lean process)

ROOT = Path(__file__).resolve().parents[1]
JOBS = ("floor", "floor, cyclic GC paused", "regen --all (in process)", "check --full (in process)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7, help="interleaved timed rounds (fastest per spec)")
    args = parser.parse_args()
    config = load_config(ROOT)
    specs = load_specs(config, None)
    source = PinnedSource(config.pins)
    lines = files = 0
    pieces: dict[str, Callable[[], object]] = {}
    for spec in specs:
        texts = [source.read(m).text for m in (spec.module, *(c.module for c in spec.companions))]  # companions too
        files += len(texts)
        lines += sum(t.count("\n") for t in texts)

        def floor(texts: list[str] = texts) -> list[str]:
            return [cst.parse_module(text).code for text in texts]

        def floor_without_gc(floor: Callable[[], list[str]] = floor) -> list[str]:
            with without_cyclic_gc():  # as regen and check run (project.without_cyclic_gc)
                return floor()

        def check_full(spec=spec) -> object:
            with without_cyclic_gc():  # as `check` runs check_spec
                return check_spec(config, spec, source, full=True)

        jobs = (floor, floor_without_gc, lambda spec=spec: regen(config, [spec], dry_run=True), check_full)
        pieces.update({f"{job}\0{spec.name}": fn for job, fn in zip(JOBS, jobs, strict=True)})
    clock = Clock("cpu")
    samples = interleaved(pieces, args.repeats, clock, keep_gc=[k for k in pieces if k.startswith("floor\0")])
    cpu = {job: sum(fastest(v) for k, v in samples.items() if k.startswith(f"{job}\0")) for job in JOBS}
    hashes = interleaved({"check": lambda: [check_spec(config, s, source) for s in specs]}, args.repeats, clock)
    cli = [sys.executable, "-m", "patchgen.cli", "check", "--root", str(ROOT)]
    run_cli = {"cli": lambda: subprocess.run(cli, check=True, capture_output=True)}
    wall = interleaved(run_cli, 5, Clock("cpu", wall=True))

    print(f"{len(specs)} specs, {files} upstream files, {lines} lines; {clock.unit}, fastest of {args.repeats} rounds")
    print(f"{'job':<36} {'cpu s':>7} {'x floor':>8} {'x floor, GC paused':>19}")
    for job in JOBS:
        print(f"{job:<36} {cpu[job]:7.3f} {cpu[job] / cpu[JOBS[0]]:8.2f} {cpu[job] / cpu[JOBS[1]]:19.2f}")
    print(f"{'check (in process, hashes)':<36} {fastest(hashes['check']):7.3f}")
    print(f"`patchgen check` (CLI, every spec): {statistics.median(wall['cli']):.2f} wall s (median of 5; target < 1)")
    print(f"regen --all / floor with the GC paused too: {cpu[JOBS[2]] / cpu[JOBS[1]]:.2f} (target <= 1.5)")


if __name__ == "__main__":
    main()

"""Timing that measures the code rather than the machine's load: the one helper the benches and kernel choices share.

On CPU the clock is the user CPU time of this process (every thread; terminated children too when asked, for a job
that runs a command): work other processes do on a shared machine does not count, unlike wall time, and neither
does the kernel's time spent on this process's behalf (system time: page faults, file reads, scheduling under load).
On CUDA it is wall time between device synchronisations (CPU time would only see the launches).

What remains on a shared machine only ever adds time: other processes' use of the caches, memory bandwidth and the
host's cores slows a run by up to 10-25% in bursts, and a job run right after another job gets a heap and caches
in whatever state that job left. So jobs compared with each other run in interleaved rounds (the order reversed
every round, so each sees every neighbour) and a job's figure is its fastest round, the least disturbed one; a
ratio is the ratio of fastest rounds (docs/performance.md has two runs of every bench ratio, with medians of
per-round ratios before and fastest rounds after). The cyclic garbage collector is paused while a sample runs, so a
collection of earlier garbage (a full one re-scans every live object: milliseconds to a second) is never charged to
whichever job happens to run next.
"""

from __future__ import annotations

import gc
import resource
import time
from collections.abc import Callable, Collection, Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["Clock", "fastest", "fastest_ratio", "interleaved", "timed"]


class Clock:
    """Seconds of work on ``device``: user CPU time of this process on CPU (plus its waited-for children's with
    ``children=True``), synchronised wall time on CUDA; ``wall=True``: wall seconds (what a user waits) on CPU too.
    Importing this module does not import torch (``bench/codegen.py`` times libcst in a process without it)."""

    def __init__(self, device: torch.device | str = "cpu", children: bool = False, wall: bool = False) -> None:
        self.device = device
        self.cuda = str(device).startswith("cuda")
        self.children = children
        self.wall = wall

    def now(self) -> float:
        if self.cuda:
            import torch

            torch.cuda.synchronize(self.device)
            return time.perf_counter()
        if self.wall:
            return time.perf_counter()
        seconds = resource.getrusage(resource.RUSAGE_SELF).ru_utime  # microseconds, unlike os.times' 10 ms ticks
        if self.children:
            seconds += resource.getrusage(resource.RUSAGE_CHILDREN).ru_utime
        return seconds

    @property
    def unit(self) -> str:
        if self.cuda:
            return "wall s (device synchronised)"
        if self.wall:
            return "wall s"
        return "user CPU s (this process and its children)" if self.children else "user CPU s (this process)"


def timed(fn: Callable[[], object], clock: Clock, keep_gc: bool = False) -> float:
    """Seconds ``fn()`` took on ``clock`` with the cyclic garbage collector paused while it runs. ``keep_gc=True``
    (a job whose cost is defined with the collector on) runs it with the collector on, after a full collection, so
    every sample starts from the same collector state and pays only for its own garbage."""
    was_enabled = gc.isenabled()
    if keep_gc:
        gc.collect()
        gc.enable()
    else:
        gc.disable()
    try:
        start = clock.now()
        fn()
        return clock.now() - start
    finally:
        (gc.enable if was_enabled else gc.disable)()


def interleaved(
    jobs: Mapping[str, Callable[[], object]],
    rounds: int,
    clock: Clock,
    warmup: int = 1,
    keep_gc: Collection[str] = (),
) -> dict[str, list[float]]:
    """Per-job seconds of ``rounds`` rounds, every job once per round in the mapping's order, reversed every other
    round; ``keep_gc`` names the jobs timed with the cyclic garbage collector running (see ``timed``)."""
    names = list(jobs)
    for _ in range(warmup):
        for name in names:
            jobs[name]()
    samples: dict[str, list[float]] = {name: [] for name in names}
    for i in range(rounds):
        for name in names if i % 2 == 0 else reversed(names):
            samples[name].append(timed(jobs[name], clock, keep_gc=name in keep_gc))
    return samples


def fastest(samples: list[float]) -> float:
    """A job's figure: its fastest sample (interference from other work only ever adds time)."""
    return min(samples)


def fastest_ratio(numerator: list[float], denominator: list[float]) -> float:
    """``fastest(numerator) / fastest(denominator)``: both sides at their least disturbed."""
    return fastest(numerator) / fastest(denominator)

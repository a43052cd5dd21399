"""Timing that measures the code rather than the machine's load: the one helper the benches and kernel choices share.

On CPU the clock is the process's CPU time (every thread of this process, children excluded): work other processes
do on a shared machine does not count, unlike wall time. On CUDA it is wall time between device synchronisations
(CPU time would only see the launches). Jobs compared with each other run in interleaved rounds, the order
alternating every round, and a ratio is the median of the per-round ratios, so what load remains (cache and memory
bandwidth shared with other processes) hits every job alike and drifts out of the ratio.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping

import torch

__all__ = ["Clock", "interleaved", "median_ratio", "timed"]


class Clock:
    """Seconds of work on ``device``: process CPU time on CPU, synchronised wall time on CUDA."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"

    def now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            return time.perf_counter()
        return time.process_time()

    @property
    def unit(self) -> str:
        return "wall s (device synchronised)" if self.cuda else "CPU s (this process)"


def timed(fn: Callable[[], object], clock: Clock) -> float:
    """Seconds ``fn()`` took on ``clock``."""
    start = clock.now()
    fn()
    return clock.now() - start


def interleaved(
    jobs: Mapping[str, Callable[[], object]], rounds: int, clock: Clock, warmup: int = 1
) -> dict[str, list[float]]:
    """Per-job seconds of ``rounds`` rounds, every job once per round, the order reversed every other round."""
    names = list(jobs)
    for _ in range(warmup):
        for name in names:
            jobs[name]()
    samples: dict[str, list[float]] = {name: [] for name in names}
    for i in range(rounds):
        for name in names if i % 2 == 0 else reversed(names):
            samples[name].append(timed(jobs[name], clock))
    return samples


def median_ratio(numerator: list[float], denominator: list[float]) -> float:
    """Median of the per-round ratios (rounds paired by index): load that drifts between rounds cancels."""
    return statistics.median(a / b for a, b in zip(numerator, denominator, strict=True))

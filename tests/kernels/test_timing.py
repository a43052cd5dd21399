"""The shared clock counts this process's own computation, not sleeping, other processes or the collector's timing."""

from __future__ import annotations

import gc
import subprocess
import sys
import time
import weakref

from runtime.kernels.timing import Clock, fastest, fastest_ratio, interleaved, timed


def _spin(seconds: float) -> None:
    """Busy-loop for ``seconds`` of wall time (on a loaded box, less CPU time than that)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_sleep_costs_nothing_and_work_costs_cpu_time():
    clock = Clock("cpu")
    assert timed(lambda: time.sleep(0.3), clock) < 0.05
    spun = timed(lambda: _spin(0.3), clock)
    assert 0.02 < spun <= 0.35  # the loop's own time, at most its wall time (plus tick rounding)


def test_children_are_counted_only_when_asked():
    """A child's CPU time reaches RUSAGE_CHILDREN once it is waited for (subprocess.run waits); the reference is the
    user time the child reports for itself."""
    code = (
        "import resource\nsum(i * i for i in range(3_000_000))\n"
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_utime)"
    )
    child = [sys.executable, "-c", code]
    reported = []

    def run() -> None:
        reported.append(float(subprocess.run(child, check=True, capture_output=True, text=True).stdout))

    with_children = timed(run, Clock("cpu", children=True))
    without = timed(run, Clock("cpu"))
    assert abs(with_children - reported[0]) <= 0.1 * reported[0] + 0.02
    assert without < 0.1 * reported[1]


def test_collector_paused_while_timing_and_restored():
    seen = []
    timed(lambda: seen.append(gc.isenabled()), Clock("cpu"))
    timed(lambda: seen.append(gc.isenabled()), Clock("cpu"), keep_gc=True)
    assert seen == [False, True]
    assert gc.isenabled()
    gc.disable()
    try:
        timed(lambda: None, Clock("cpu"), keep_gc=True)
        assert not gc.isenabled()  # the caller's choice survives
    finally:
        gc.enable()


def test_keep_gc_starts_from_a_collected_heap():
    """Earlier cyclic garbage is collected before a ``keep_gc`` sample starts, not during it."""

    class Node:
        pass

    node = Node()
    node.self = node  # a reference cycle: only the cyclic collector frees it
    alive = weakref.ref(node)
    del node
    gc.disable()
    try:
        states = []
        timed(lambda: states.append(alive() is None), Clock("cpu"), keep_gc=True)
        assert states == [True]
    finally:
        gc.enable()


def test_rounds_alternate_and_figures_are_fastest_rounds():
    calls = []
    jobs = {name: (lambda name=name: calls.append(name)) for name in "abc"}
    samples = interleaved(jobs, rounds=3, clock=Clock("cpu"), warmup=1)
    assert calls == list("abcabccbaabc")
    assert {k: len(v) for k, v in samples.items()} == {"a": 3, "b": 3, "c": 3}
    assert fastest([0.31, 0.25, 0.40]) == 0.25
    assert fastest_ratio([0.5, 0.3, 0.4], [0.2, 0.25, 0.3]) == 0.3 / 0.2

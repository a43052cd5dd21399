"""A run's console: on a terminal the tqdm bar (its own elapsed time, rate and ETA) with the step lines written
above it; elsewhere (nohup, a cluster log: ``stream.isatty()`` false) each step line carries what the bar would
show: a timestamp, the elapsed time, the ETA and the throughput, e.g.::

    2026-11-24 09:12:01 step   30/100 loss 5.2113 ... | elapsed 0:01:02 eta 0:02:24 samples/s 3.9

Elapsed time and ETA count from the start of this process's loop (a resumed run's steps before its checkpoint are
not in them); the ETA is the mean time per step so far times the steps left. The throughput (``samples/s`` when
the run says how many samples a step takes: DiTs, RL) is over the wall time since the previous line's step, so it
includes checkpoints and validation samples.
"""

from __future__ import annotations

import datetime
import time
from typing import TextIO

__all__ = ["Console", "clock"]


def clock(seconds: float) -> str:
    """``H:MM:SS``."""
    return str(datetime.timedelta(seconds=max(0, round(seconds))))


class Console:
    def __init__(
        self,
        stream: TextIO,
        total_steps: int,
        start_step: int = 0,
        progress: bool = True,
        samples_per_step: int | None = None,
    ) -> None:
        self.stream, self.total_steps, self.start_step = stream, total_steps, start_step
        self.samples_per_step = samples_per_step
        self.started = self._last_time = time.monotonic()
        self._last_step = start_step
        self.bar = None
        if progress and stream.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=start_step, dynamic_ncols=True, file=stream)

    def say(self, line: str) -> None:
        """A line outside the step lines (resumed from, alarms): above the bar on a terminal."""
        if self.bar is not None:
            self.bar.write(line, file=self.stream)
        else:
            print(line, file=self.stream, flush=True)

    def advance(self, step: int, postfix: str | None = None) -> None:
        """Move the bar to ``step`` (no output off a terminal)."""
        if self.bar is not None:
            if postfix:
                self.bar.set_postfix_str(postfix)
            self.bar.update(step - self.bar.n)

    def step_line(self, step: int, line: str) -> None:
        """The line of ``step`` (after ``advance``): as is on a terminal, else with timestamp, elapsed, ETA and
        throughput."""
        now = time.monotonic()
        if self.bar is not None:
            self.bar.write(line, file=self.stream)
        else:
            print(
                f"{datetime.datetime.now():%Y-%m-%d %H:%M:%S} {line} | {self.timing(step, now)}",
                file=self.stream,
                flush=True,
            )
        self._last_time, self._last_step = now, step

    def timing(self, step: int, now: float) -> str:
        elapsed = now - self.started
        done = step - self.start_step
        eta = elapsed / done * (self.total_steps - step) if done > 0 else 0.0
        text = f"elapsed {clock(elapsed)} eta {clock(eta)}"
        interval = now - self._last_time
        if self.samples_per_step and step > self._last_step and interval > 0:
            text += f" samples/s {self.samples_per_step * (step - self._last_step) / interval:,.2f}"
        return text

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

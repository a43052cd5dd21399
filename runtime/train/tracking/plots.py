"""The end-of-run curve PNG (matplotlib, Agg canvas: no display, no pyplot state), drawn from ``metrics.jsonl``.

The JSONL file is appended to by every run in the directory, so the curve follows the lineage of the run that just
ended: a record whose step is lower than the one before starts a new run (a fresh run at step 1, a resumed run at
the step after its checkpoint), and it drops the records of the steps it repeats; records of the same step merge (an
eval loss logged beside the training loss).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["Panel", "plot_curves", "run_history"]


@dataclass(frozen=True)
class Panel:
    """One plot: ``keys`` against the step, on one y axis (logarithmic when ``log_y`` and the values are positive and
    span more than a decade, e.g. a loss from 10 to 0.1); ``band`` names each key's standard-deviation key."""

    title: str
    keys: tuple[str, ...]
    band: tuple[tuple[str, str], ...] = ()
    log_y: bool = False


def run_history(jsonl: Path) -> list[dict[str, Any]]:
    """The records of the run that wrote last to ``jsonl``, one merged record per step, in step order."""
    by_step: dict[int, dict[str, Any]] = {}
    previous = None
    with jsonl.open(encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:  # a line cut short by a killed run
                continue
            step = record.get("step")
            if not isinstance(step, int):
                continue
            if previous is not None and step < previous:
                by_step = {s: r for s, r in by_step.items() if s < step}
            by_step.setdefault(step, {}).update(record)
            previous = step
    return [by_step[s] for s in sorted(by_step)]


def _series(history: Sequence[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    steps, values = [], []
    for record in history:
        value = record.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
            steps.append(record["step"])
            values.append(float(value))
    return steps, values


def plot_curves(history: Sequence[dict[str, Any]], panels: Sequence[Panel], path: Path, title: str) -> Path | None:
    """Write ``path`` (PNG, atomically) with one subplot per panel that has data; None when no panel has any."""
    shown = [p for p in panels if any(_series(history, k)[0] for k in p.keys)]
    if not shown:
        return None
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    figure = Figure(figsize=(7, 3 * len(shown)), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(len(shown), 1, squeeze=False)[:, 0]
    bands = {key: std for p in shown for key, std in p.band}
    for ax, panel in zip(axes, shown, strict=True):
        for key in panel.keys:
            steps, values = _series(history, key)
            if not steps:
                continue
            marker = "o" if len(steps) < 30 else None
            ax.plot(steps, values, label=key, marker=marker, markersize=3)
            if key in bands:
                by_step = dict(zip(*_series(history, bands[key]), strict=True))
                low = [v - by_step.get(s, 0.0) for s, v in zip(steps, values, strict=True)]
                high = [v + by_step.get(s, 0.0) for s, v in zip(steps, values, strict=True)]
                ax.fill_between(steps, low, high, alpha=0.2)
        ax.set_title(panel.title)
        ax.set_xlabel("step")
        values = [v for k in panel.keys for v in _series(history, k)[1]]
        if panel.log_y and min(values) > 0 and max(values) > 10 * min(values):
            ax.set_yscale("log")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend(loc="best")
    figure.suptitle(title)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.tmp")
    figure.savefig(partial, format="png")
    os.replace(partial, path)
    return path

"""What ``python -m runtime.plan`` proposes for a device count: the first layout that fits in ``candidates``' order
(the least recomputation and communication: checkpointing off, then the smallest sp, shard group and ep), and the
runners-up that fit after it, each with its per-rank memory. The order is not one of memory: the proposal often fills
the device while a checkpointed layout (maybe the configured one) needs half of it, so the runners-up are listed with
their totals and the configured layout is marked where it appears (no torch here)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from runtime.plan.layout import Layout, Memory

__all__ = ["ORDER", "RUNNERS_UP", "choice_lines"]

RUNNERS_UP = 3  # fitting layouts listed after the proposal
ORDER = "least recomputation and communication first: checkpointing off, then the smallest sp, shard group, ep"
GIB = 2**30


def _mark(layout: Layout, configured: Layout) -> str:
    return " (the configured layout)" if layout == configured else ""


def choice_lines(fits: Sequence[tuple[Layout, Memory]], configured: Layout, row: Callable[[Memory], str]) -> list[str]:
    """The report's lines for ``fits`` (``layout.fitting`` over the candidates: the proposal, then its runners-up);
    ``row`` spells out the proposal's memory."""
    if not fits:
        return ["    first layout that fits: none (more GPUs, or a shorter micro-batch)"]
    (best, memory), rest = fits[0], fits[1:]
    lines = [
        f"    first layout that fits ({ORDER}; not the least memory):",
        f"      {best.describe()}{_mark(best, configured)}\n      {row(memory)}",
    ]
    if rest:
        lines.append(f"    runners-up, in that order ({len(rest)} next that fit):")
        lines += [f"      {lay.describe()}{_mark(lay, configured)}: {mem.total / GIB:.1f} GiB" for lay, mem in rest]
    return lines

"""What the measure steps share: the device, the sizes, the clock and the device's bf16 peak.

A step module has ``run(ctx) -> dict``; it raises ``Skipped`` for what cannot run here (with the reason) and lets
any other exception through (the runner records it as a failure and goes on).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from runtime.kernels.timing import Clock, fastest, interleaved

__all__ = ["Context", "Skipped", "peak_tflops", "time_jobs"]

# Dense bf16 peak (no sparsity) by device name, TFLOP/s; the first key found in the name wins, so the more
# specific names come first. Sources: NVIDIA's H100/H200 data sheets (SXM figures; H200 has H100 SXM's tensor cores).
PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H200", 989.0),
    ("H100", 989.0),  # H100 SXM (reports as "NVIDIA H100 80GB HBM3")
)


class Skipped(Exception):
    """A step (or part of one) that cannot run here; the message is the reason."""


@dataclass(frozen=True)
class Context:
    """Where a step runs: ``size`` is ``tiny`` (the dry run, CPU) or ``real`` (the GPU); ``repeats`` timed rounds."""

    device: torch.device
    size: str
    repeats: int

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def dtype(self) -> torch.dtype:
        """bf16 on the GPU (what training runs); fp32 on CPU, where bf16 matmuls are slow and the dry run is tiny."""
        return torch.bfloat16 if self.cuda else torch.float32

    @property
    def clock(self) -> Clock:
        return Clock(self.device, wall=not self.cuda)  # the dry run's figures are not results: wall time is enough

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)


def peak_tflops(device: torch.device) -> tuple[float | None, str]:
    """(dense bf16 peak TFLOP/s, the device name it was looked up by); None where the table has no entry."""
    if device.type != "cuda":
        return None, "cpu"
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_BF16_TFLOPS if key in name), None), name


def time_jobs(ctx: Context, jobs: dict[str, Callable[[], Any]]) -> dict[str, float]:
    """Each job's fastest of ``ctx.repeats`` interleaved rounds after one warm-up round, in seconds."""
    samples = interleaved(jobs, ctx.repeats, ctx.clock, warmup=1)
    return {name: fastest(times) for name, times in samples.items()}


def mfu(flops: float, seconds: float, device: torch.device) -> dict[str, Any]:
    """Achieved TFLOP/s and model FLOPs utilisation against the table's peak (None off the table)."""
    peak, name = peak_tflops(device)
    tflops = flops / seconds / 1e12
    return {"tflops": tflops, "peak_tflops": peak, "peak_of": name, "mfu": tflops / peak if peak else None}


def release(device: torch.device) -> None:
    """Free what the previous step cached and restart the peak counter (each step measures its own)."""
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)

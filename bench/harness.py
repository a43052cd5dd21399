"""What the benchmarks share: the command line (``--device``, ``--dtype``, ``--repeats``), timing that measures the
code and not the machine's load (``runtime.kernels.timing``: user CPU time on CPU, synchronised wall time on CUDA,
interleaved rounds, each job's fastest round), tokens/s and MFU, activation memory saved for backward, and a
worst-rank figure over gloo ranks. No bench keeps its own timing code."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python bench/x.py` from the repository root

import torch  # noqa: E402

from runtime.kernels.timing import Clock, fastest, fastest_ratio, interleaved, timed  # noqa: E402
from tests.dist_utils import run_distributed  # noqa: E402  (the one multi-rank launcher; ranks are pooled)

__all__ = [
    "Bench",
    "Clock",
    "bench_args",
    "fastest",
    "fastest_ratio",
    "flops_of",
    "interleaved",
    "saved_activation_bytes",
    "setup",
    "throughput",
    "timed",
    "worst_rank",
]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class Bench:
    """Where and how a bench runs, from its command line."""

    device: torch.device
    dtype: torch.dtype
    repeats: int
    clock: Clock

    @property
    def label(self) -> str:
        dtype = next(k for k, v in DTYPES.items() if v == self.dtype)
        threads = torch.get_num_threads()
        return f"{dtype}, {self.device}, {threads} thread(s), {self.clock.unit}, fastest of {self.repeats}"

    def autocast(self):
        """bf16 autocast where the bench runs a trainer whose parameters stay fp32; a no-op for fp32."""
        return torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype != torch.float32)


def bench_args(doc: str | None, repeats: int) -> argparse.ArgumentParser:
    """The options every bench takes; ``parse`` them with ``Bench`` fields via ``setup``."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    parser.add_argument("--repeats", type=int, default=repeats, help="interleaved timed rounds (fastest)")
    return parser


def _keep_freed_memory() -> None:
    """glibc keeps what is freed (no mmap for large blocks, no heap trimming), as CUDA's caching allocator does: a
    repeated step then does not page-fault its large buffers back in. Those faults were ~25% of the CPU time of an
    MoE step (all kernel time) and its noisiest part; on a GPU they do not exist. Linux/glibc only."""
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    libc.mallopt(-4, 0)  # M_MMAP_MAX: never mmap
    libc.mallopt(-1, 2**31 - 1)  # M_TRIM_THRESHOLD: never give the heap back


def setup(args: argparse.Namespace) -> Bench:
    """On CPU: one intra-op thread (the CPU time of a multi-threaded op includes its threads' spin-waits, which grow
    with the machine's load; one thread's CPU time does not) and freed memory kept (``_keep_freed_memory``)."""
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here (torch.cuda.is_available() is False)")
    if device.type == "cpu":
        torch.set_num_threads(1)
        _keep_freed_memory()
    return Bench(device=device, dtype=DTYPES[args.dtype], repeats=args.repeats, clock=Clock(device))


def peak_tflops(device: torch.device) -> float | None:
    """The device's dense bf16 peak (runtime.train.metrics' table); None on CPU or an unknown GPU."""
    from runtime.train.metrics import detect_peak_tflops

    return detect_peak_tflops() if device.type == "cuda" else None


def throughput(tokens: int, seconds: float, flops: float, device: torch.device) -> str:
    """``tokens/s``, achieved TFLOP/s and MFU against the device's bf16 peak (where the peak is known)."""
    tflops = flops / seconds / 1e12
    peak = peak_tflops(device)
    mfu = f"MFU {tflops / peak:6.1%} of {peak:.0f} TFLOP/s bf16" if peak else "MFU - (no known peak on this device)"
    return f"{tokens / seconds:10.0f} tokens/s  {tflops:8.3f} TFLOP/s  {mfu}"


def flops_of(fn: Callable[[], Any]) -> int:
    """FLOPs torch's own counter sees while ``fn()`` runs (forward and, if ``fn`` runs it, backward)."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def saved_activation_bytes(loss_of: Callable[[], torch.Tensor]) -> int:
    """Bytes of distinct tensors autograd saves for backward while `loss_of()` runs its forward (then backward)."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, torch.nn.Parameter):
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = loss_of()
    loss.backward()
    return sum(seen.values())


def worst_rank(worker: Callable[..., int], world: int, *args: Any) -> int:
    """`worker(rank, world, *args)` on `world` gloo ranks (process group initialised); the largest figure."""
    return max(run_distributed(worker, world, *args, timeout=1800))

"""Measured peak memory of CPU code: the bytes glibc's malloc holds (in-use heap + mmapped chunks), sampled after
every tensor operation. What the plan's estimates are validated against (``tests/gpu_readiness/test_plan.py``) and
what ``bench/dit_train.py`` reports. Linux/glibc only."""

from __future__ import annotations

import ctypes
import gc
from typing import Any

from runtime.torch_compat import TorchDispatchMode

__all__ = ["MallocPeak"]


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks")
    ] + [("keepcost", ctypes.c_size_t)]


class MallocPeak(TorchDispatchMode):
    """Peak of the bytes malloc holds (in-use heap + mmapped), sampled after every tensor op; ``offset()`` (bytes
    not to count at that moment, e.g. gradients accumulated so far) is subtracted from every sample."""

    def __init__(self, offset: Any = None) -> None:
        super().__init__()
        self.libc = ctypes.CDLL("libc.so.6")
        self.libc.mallinfo2.restype = _Mallinfo2
        self.libc.mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD fixed: large tensors always mmapped and counted
        self.offset = offset or (lambda: 0)
        self.peak = self.base = 0

    def in_use(self) -> int:
        info = self.libc.mallinfo2()
        return info.uordblks + info.hblkhd

    def __enter__(self) -> MallocPeak:
        # Garbage left by earlier code, freed by the collector in the middle of the measured region, would lower the
        # samples below the base by its size (a process that ran other work first measured 38% low): collect it
        # first, and keep the collector off until the region ends.
        self._collector_was_on = gc.isenabled()
        gc.collect()
        gc.disable()
        self.base = self.peak = self.in_use()
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            if self._collector_was_on:
                gc.enable()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.peak = max(self.peak, self.in_use() - self.offset())
        return out

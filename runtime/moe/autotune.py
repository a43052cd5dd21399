"""The grouped-matmul backend that is fastest on this machine, measured once per problem shape (as Triton autotunes).

A fixed rule was wrong on a loaded 2-core box: it chose ``torch._grouped_mm`` (0.95x of transformers' grouped_mm)
while the padded ``bmm`` measured 1.39x in the same run. So ``grouped_linear(backend=None)`` asks ``choose_backend``:
for a problem of at least ``MIN_MACS`` multiply-adds it times forward + backward of every backend that can run it
(``pick_backend``'s eligibility) on detached copies of this call's own rows, weights and expert counts, in
interleaved rounds on ``runtime.kernels.timing``'s clock (user CPU time on CPU, synchronised wall time on CUDA), and
keeps the backend with the fastest round for (device, dtype, experts, N, K, rows rounded up to a power of two) for
the life of the process. Smaller problems take the fixed rule (``pick_backend``): a timing of microseconds says
nothing, and the tiny models of the test suite stay deterministic across processes. While ``torch.compile``
traces, the cached choice or the fixed rule is used (nothing is timed inside a graph).

Backends round differently (fp32 rounding, well within 1e-6), so two processes that measured different winners are
not bitwise identical; ``PATCHGEN_MOE_BACKEND=torch|segment|bmm`` pins the backend wherever it can run (e.g. for a
bitwise resume in another process).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
from torch import Tensor

from runtime.kernels.timing import Clock, fastest, interleaved

__all__ = ["MIN_MACS", "ROUNDS", "choose_backend", "eligible_backends", "measured"]

MIN_MACS = 1 << 24  # ~17M multiply-adds per projection (a few ms of fp32 GEMM on one CPU core): below, the fixed rule
ROUNDS = 3  # timed rounds per backend, after one warm-up round
ENV = "PATCHGEN_MOE_BACKEND"

_measured: dict[tuple, str] = {}


def measured() -> dict[tuple, str]:
    """The choices this process measured so far: key -> backend (read-only use: reports, benches)."""
    return dict(_measured)


def eligible_backends(x: Tensor, weight: Tensor, fixed: Callable[[Tensor, Tensor], str]) -> tuple[str, ...]:
    """Backends that can run this problem: ``torch`` only where the fixed rule (``pick_backend``'s alignment/dtype
    rule) allows."""
    return ("torch", "segment", "bmm") if fixed(x, weight) == "torch" else ("segment", "bmm")


def _key(x: Tensor, weight: Tensor) -> tuple:
    rows = max(1, x.size(0))
    return (str(x.device), x.dtype, *weight.shape, 1 << (rows - 1).bit_length())


def _time_backends(
    x: Tensor, weight: Tensor, counts: Tensor, backends: tuple[str, ...], grouped_linear: Callable[..., Tensor]
) -> str:
    xs = x.detach().requires_grad_(True)
    ws = weight.detach().requires_grad_(True)
    grad = torch.randn(x.size(0), weight.size(1), device=x.device, dtype=x.dtype)

    def job(backend: str):
        def run() -> None:
            with torch.enable_grad():
                torch.autograd.grad(grouped_linear(xs, ws, counts, backend), (xs, ws), grad)

        return run

    samples = interleaved({b: job(b) for b in backends}, ROUNDS, Clock(x.device))
    return min(backends, key=lambda b: fastest(samples[b]))


def choose_backend(
    x: Tensor,
    weight: Tensor,
    counts: Tensor,
    grouped_linear: Callable[..., Tensor],
    pick_backend: Callable[[Tensor, Tensor], str],
    known: tuple[str, ...],
) -> str:
    """The backend ``grouped_linear`` runs when none is named (see the module docstring). The caller hands in its
    own ``grouped_linear``, fixed rule and backend names, so this module does not import ``runtime.moe.grouped``."""
    backends = eligible_backends(x, weight, pick_backend)
    pinned = os.environ.get(ENV)
    if pinned:
        if pinned not in known:
            raise ValueError(f"{ENV}={pinned!r}: expected one of {', '.join(known)}")
        if pinned in backends:  # torch._grouped_mm pinned for a problem it cannot run: the fixed rule
            return pinned
        return pick_backend(x, weight)
    if x.size(0) * weight.size(1) * weight.size(2) < MIN_MACS or len(backends) == 1:
        return pick_backend(x, weight)
    key = _key(x, weight)
    if key not in _measured:
        if torch.compiler.is_compiling():
            return pick_backend(x, weight)
        _measured[key] = _time_backends(x, weight, counts, backends, grouped_linear)
    return _measured[key]

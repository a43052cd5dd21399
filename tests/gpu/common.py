"""What the CUDA tests share: the device, moving inputs onto it, norm-wise relative errors, determinism."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

CUDA = torch.device("cuda")


def on(value: Any, device: torch.device | None = None, dtype: torch.dtype | None = None) -> Any:
    """Tensors (in dicts and lists too) on ``device``; floating ones in ``dtype`` when given (a DiT's timestep stays
    fp32, as pipelines pass it)."""
    device = CUDA if device is None else device
    if isinstance(value, dict):
        return {k: on(v, device, None if k == "timestep" else dtype) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(on(v, device, dtype) for v in value)
    if isinstance(value, torch.Tensor):
        return value.to(device, dtype if dtype is not None and value.is_floating_point() else None)
    return value


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@contextmanager
def deterministic() -> Iterator[None]:
    """Deterministic kernels for the bitwise comparisons (two runs of the same ops must give the same bits): torch's
    deterministic algorithms, SDPA's math backend (the fused kernels' backward may accumulate with atomics; the
    fused backends have their own tests), and ``CUBLAS_WORKSPACE_CONFIG=:4096:8``, set by bench/gpu_check."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        with sdpa_kernel([SDPBackend.MATH]):
            yield
    finally:
        torch.use_deterministic_algorithms(was)

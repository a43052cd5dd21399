"""What the benchmarks share: activation memory saved for backward, and a worst-rank figure over gloo ranks."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python bench/x.py` from the repository root

from tests.dist_utils import run_distributed  # noqa: E402  (the one multi-rank launcher; ranks are pooled)


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

"""The forward process of the algorithms that train on clean samples (DiffusionNFT on the rollout's final samples,
Diffusion-DPO on preference pairs): the seeded ``(t, eps)`` draws and the noised ``x_t`` with its target velocity.

Why one module for both: a draw is a function of ``(model.seed, iteration, draw, global sample)`` alone, so SP ranks
draw alike, ``D`` replicas draw what one process with ``D`` times the samples draws, and a resumed run draws what the
uninterrupted run drew, whichever trainer (``runtime/rl/update.py``, ``runtime/rl/offline.py``) asks.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

__all__ = ["forward_draws", "noised"]


def forward_draws(seed: int, step: int, draw: int, first: int, count: int, shape: Any) -> tuple[torch.Tensor, ...]:
    """``(t [count], eps [count, *shape])`` of global samples ``first ..`` for draw ``draw`` of iteration ``step``."""
    ts, noises = [], []
    for q in range(first, first + count):
        digest = hashlib.sha256(f"patchgen.rl.diffusionnft:{seed}:{step}:{draw}:{q}".encode()).digest()
        g = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
        ts.append(torch.rand((), generator=g))
        noises.append(torch.randn(tuple(shape), generator=g))
    return torch.stack(ts), torch.stack(noises)


def noised(x0: torch.Tensor, eps: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x_t, v)``: the forward process at per-sample times ``t`` ``[B]`` and its target velocity."""
    tt = t.reshape(-1, *([1] * (x0.dim() - 1))).to(x0.dtype)
    return (1 - tt) * x0 + tt * eps, eps - x0

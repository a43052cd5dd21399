"""Attention keyword arguments indexed by query head, cut to the heads an SP rank attends with (Ulysses and USP)."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["PER_HEAD_KWARGS", "heads_of_rank"]


# Keyword arguments indexed by query head (attention sinks: a learned per-head logit in the softmax denominator).
PER_HEAD_KWARGS = ("s_aux",)


def heads_of_rank(kwargs: dict[str, Any], num_heads: int, size: int, rank: int) -> dict[str, Any]:
    """``kwargs`` with every per-head tensor (``PER_HEAD_KWARGS``) cut to the heads this rank attends with after the
    all-to-all (the ``rank``-th of ``size`` contiguous head chunks): the inner implementation sees this rank's heads,
    so a full per-head tensor would be applied to the wrong heads (or fail on its length)."""
    out = dict(kwargs)
    for name in PER_HEAD_KWARGS:
        value = out.get(name)
        if isinstance(value, torch.Tensor) and value.dim() >= 1 and size > 1:
            if value.shape[0] != num_heads:
                raise ValueError(f"{name}: expected one entry per query head ({num_heads}), got {tuple(value.shape)}")
            chunk = num_heads // size
            out[name] = value[rank * chunk : (rank + 1) * chunk]
    return out

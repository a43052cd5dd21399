"""DiT hooks for a token grid split by whole rows (Sana): the split handed to callees that receive nothing, the
local row count, the depthwise conv over the grid with a halo, and linear attention over the whole SP group.

Every hook is the upstream callee / value itself when SP is off (``shard`` None), so the generated code runs
upstream's path bitwise. The split is ``dit/shard_tokens`` with ``rows``: each SP rank holds ``rows / sp`` whole
grid rows (no padding; a grid whose rows do not divide by sp is refused there).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from runtime.diffusion.sp import TokenShard
from runtime.diffusion.sp_linear import linear_attention_kv
from runtime.parallel.halo import halo_conv2d
from runtime.parallel.sites import mark_site

__all__ = ["grid_halo_conv2d", "local_grid_rows", "sp_linear_kv", "with_split"]


def with_split(shard: TokenShard | None, fn: Callable, name: str = "dit_sp") -> Callable:
    """``fn`` itself when SP is off; otherwise ``fn`` with the split as the keyword argument ``name`` (a block, an
    attention module, a feed-forward, or the checkpoint function that calls a block)."""
    return fn if shard is None else functools.partial(fn, **{name: shard})


def local_grid_rows(rows: int, shard: TokenShard | None) -> int:
    """The grid rows this rank holds: ``rows`` when SP is off, ``rows / sp`` under the row-aligned split."""
    return rows if shard is None else rows // shard.size


def grid_halo_conv2d(shard: TokenShard | None, conv: torch.nn.Conv2d, x: Tensor) -> Tensor:
    """``conv(x)`` over this rank's block of whole grid rows, equal to that block of ``conv`` over the whole grid
    (the neighbours' ``k // 2`` rows exchanged); ``conv(x)`` when SP is off. The convolution's caller passed a
    checked site (``runtime.parallel.sites``: the self-check's census watches it as a mixer)."""
    if shard is None:
        return conv(x)
    mark_site(conv)
    return halo_conv2d(conv, x, x.size(2), shard.group)


def sp_linear_kv(value: Tensor, key: Tensor, shard: TokenShard | None, module: Any = None) -> Tensor:
    """Linear attention's ``value @ key`` summed over every token of the SP group (padding keys zeroed);
    ``torch.matmul(value, key)`` when SP is off or the call receives no split. ``module`` (the attention module)
    is marked as having passed a checked site (``runtime.parallel.sites``)."""
    mark_site(module)
    if shard is None:
        return torch.matmul(value, key)
    valid = max(0, min(shard.local, shard.tokens - shard.rank * shard.local))
    return linear_attention_kv(value, key, valid, shard.group)

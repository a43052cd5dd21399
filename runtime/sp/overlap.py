"""Ulysses all-to-alls issued asynchronously, so that communication overlaps the work around it.

The Ulysses hooks (LM ``runtime/sp/ulysses.py``, DiT ``runtime/diffusion/sp.py``) receive query, key and value
already projected (the projections run in the generated model code before the hook), so what can hide a transfer is
the packing of the next tensor and the transfers of the others. With overlap on, one autograd function:

* forward: packs q and launches its all-to-all (``async_op=True``), packs and launches k, then v, and only then
  waits for q, unpacks it, waits for k, ... The waits are the last thing before the hook returns to the attention
  kernel. Three transfers are in flight at once instead of one after the other.
* backward: the three inverse all-to-alls of dq, dk, dv are launched together and waited together (autograd hands
  the three gradients to one backward call, where three separate functions would serialise them).

All-to-alls only move elements (here each tensor is packed alone, as ``runtime.parallel.collectives`` packs one; its
synchronous path, the default, sends q, k and v in one all-to-all), so results are bitwise identical with overlap on
and off (tested). Off runs exactly the synchronous code path: the switch costs one bool check per attention call.

The switch is ``ParallelState.overlap`` (``parallel.overlap`` in the run config, applied by ``setup_parallel``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from runtime.parallel.collectives import _check_divisible, gather_seq_scatter_heads_many
from runtime.parallel.state import get_parallel_state, parallel_state

__all__ = ["overlap", "overlap_enabled", "seq_to_heads"]


def overlap_enabled() -> bool:
    return get_parallel_state().overlap


@contextmanager
def overlap(enabled: bool) -> Iterator[None]:
    """The current parallel state with its switch set to ``enabled`` inside the block (tests, benches)."""
    with parallel_state(dataclasses.replace(get_parallel_state(), overlap=bool(enabled))):
        yield


def _launch(x: Tensor, scatter_dim: int, size: int, group: ProcessGroup) -> tuple[Tensor, Tensor, Any]:
    """(receive buffer, send buffer, work): the caller holds the send buffer until the wait, so no allocator can
    hand its memory out while the transfer may still read it."""
    send = torch.stack(x.chunk(size, dim=scatter_dim)).contiguous()
    recv = torch.empty_like(send)
    return recv, send, dist.all_to_all_single(recv, send, group=group, async_op=True)


def _all_to_all_async(
    xs: Sequence[Tensor], scatter_dim: int, gather_dim: int, group: ProcessGroup, size: int
) -> tuple[Tensor, ...]:
    """Every tensor's all-to-all in flight before the first wait; same packing as collectives._all_to_all."""
    pending = [_launch(x, scatter_dim, size, group) for x in xs]
    out = []
    for recv, _send, work in pending:
        work.wait()
        out.append(torch.cat(recv.unbind(0), dim=gather_dim))
    return tuple(out)


class _AllToAllMany(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, scatter_dim: int, gather_dim: int, group: ProcessGroup, size: int, *xs: Tensor) -> Any:
        ctx.scatter_dim, ctx.gather_dim, ctx.group, ctx.size = scatter_dim, gather_dim, group, size
        return _all_to_all_async(xs, scatter_dim, gather_dim, group, size)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> Any:
        back = _all_to_all_async(grads, ctx.gather_dim, ctx.scatter_dim, ctx.group, ctx.size)
        return (None, None, None, None, *back)


def seq_to_heads(
    tensors: Sequence[Tensor], seq_dim: int, head_dim: int, group: ProcessGroup | None
) -> tuple[Tensor, ...]:
    """``gather_seq_scatter_heads`` of each tensor (q, k, v): asynchronously and together when overlap is on, else
    in one synchronous all-to-all (``gather_seq_scatter_heads_many``).

    All tensors must have the same number of dims; each keeps its own shape otherwise.
    """
    if not overlap_enabled() or group is None or dist.get_world_size(group) == 1:
        return gather_seq_scatter_heads_many(tensors, seq_dim=seq_dim, head_dim=head_dim, group=group)
    size = dist.get_world_size(group)
    for t in tensors:
        _check_divisible(t, head_dim, size, "seq_to_heads (heads)")
    ndim = tensors[0].dim()
    return _AllToAllMany.apply(head_dim % ndim, seq_dim % ndim, group, size, *tensors)

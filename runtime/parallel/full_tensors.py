"""Many sharded DTensors made whole with one collective per sharding, not one per tensor.

The start-up self-check compares every parameter's gradient with one process's; under FSDP2 each gradient is a
DTensor sharded on dim 0, and ``full_tensor()`` per parameter costs one all-gather each (hundreds per comparison, a
millisecond or more of latency each on gloo). Tensors that share a mesh and placements, with exactly one mesh
dimension sharding dim 0 and every other replicating, are gathered together: each rank's local pieces, padded to
the size ``torch.chunk`` gives the first rank (DTensor's ``Shard(0)`` splits as ``torch.chunk`` does), in one flat
buffer, one ``all_gather`` over that mesh dimension's group, and each tensor cut back out of every rank's buffer.
Any other placement (a strided or 2-D sharding) takes ``full_tensor()``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

__all__ = ["full_tensors"]


def _chunk_rows(rows: int, world: int, rank: int) -> int:
    """How many of ``rows`` the ``rank``-th of ``world`` chunks holds under ``torch.chunk`` (the last may be short,
    trailing ones empty)."""
    size = math.ceil(rows / world) if rows else 0
    return max(0, min(size, rows - rank * size))


def _row_sharded_dim(tensor: DTensor) -> int | None:
    """The one mesh dimension that shards dim 0 while every other replicates, or None."""
    sharding = [i for i, p in enumerate(tensor.placements) if not p.is_replicate()]
    if len(sharding) == 1 and tensor.placements[sharding[0]].is_shard(0):
        return sharding[0]
    return None


def full_tensors(tensors: Mapping[str, DTensor]) -> dict[str, torch.Tensor]:
    """Every DTensor of ``tensors`` whole, on its device (collective: every rank calls it with the same names in the
    same order)."""
    out: dict[str, torch.Tensor] = {}
    groups: dict[tuple, list[str]] = {}
    for name, tensor in tensors.items():
        mesh_dim = _row_sharded_dim(tensor)
        if mesh_dim is None:
            out[name] = tensor.full_tensor()
        else:
            groups.setdefault((tensor.device_mesh, mesh_dim, tensor.dtype), []).append(name)
    for (mesh, mesh_dim, dtype), names in groups.items():
        world = mesh.size(mesh_dim)
        shapes = [tensors[name].shape for name in names]
        widths = [math.prod(shape[1:]) for shape in shapes]
        slots = [_chunk_rows(shape[0], world, 0) * width for shape, width in zip(shapes, widths, strict=True)]
        pieces = []
        for name, slot in zip(names, slots, strict=True):
            local = tensors[name].to_local().reshape(-1)
            pieces.append(torch.nn.functional.pad(local, (0, slot - local.numel())))
        mine = torch.cat(pieces) if pieces else torch.empty(0, dtype=dtype)
        gathered = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(gathered, mine.contiguous(), group=mesh.get_group(mesh_dim))
        start = 0
        for name, shape, width, slot in zip(names, shapes, widths, slots, strict=True):
            parts = [
                buffer[start : start + _chunk_rows(shape[0], world, rank) * width]
                for rank, buffer in enumerate(gathered)
            ]
            out[name] = torch.cat(parts).reshape(shape)
            start += slot
    return {name: out[name] for name in tensors}

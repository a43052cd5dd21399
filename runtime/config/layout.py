"""The arithmetic of a parallel layout: which sizes tile a world of processes, and the fewest processes a layout
runs on. torch-free, so that the command line checks a config's layout against the processes it will start before
any rank starts (``runtime/cli.py``); ``runtime.parallel.state`` builds the meshes from the same rules."""

from __future__ import annotations

import math

__all__ = ["fewest_processes", "resolve_layout"]


def resolve_layout(
    world_size: int,
    dp_replicate_size: int,
    dp_shard_size: int | None,
    sp_size: int,
    ep_size: int = 1,
    ring_size: int = 1,
) -> int:
    """Check that the sizes tile the world exactly and return dp_shard_size (derived when None)."""
    if isinstance(ring_size, bool) or not isinstance(ring_size, int) or ring_size < 1:
        raise ValueError(f"ring_size must be a positive integer, got {ring_size!r}")
    if isinstance(sp_size, int) and sp_size >= 1 and sp_size % ring_size:
        raise ValueError(f"ring_size={ring_size} must divide sp_size={sp_size} (sp = ulysses x ring)")
    shard = "auto" if dp_shard_size is None else dp_shard_size
    sizes = f"dp_replicate_size={dp_replicate_size}, dp_shard_size={shard}, sp_size={sp_size}, world size {world_size}"
    given = [s for s in (dp_replicate_size, dp_shard_size, sp_size, ep_size) if s is not None]
    if any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in given):
        raise ValueError(f"parallel sizes must be positive integers: {sizes}, ep_size={ep_size}")
    if dp_shard_size is None:
        if world_size % (dp_replicate_size * sp_size):
            raise ValueError(f"world size is not a multiple of dp_replicate_size x sp_size: {sizes}")
        dp_shard_size = world_size // (dp_replicate_size * sp_size)
    if dp_replicate_size * dp_shard_size * sp_size != world_size:
        raise ValueError(f"dp_replicate_size x dp_shard_size x sp_size must equal the world size: {sizes}")
    if (dp_shard_size * sp_size) % ep_size:
        raise ValueError(
            f"ep_size={ep_size} must divide dp_shard_size x sp_size = {dp_shard_size * sp_size} (experts are "
            f"sharded within one data-parallel replica): {sizes}"
        )
    return dp_shard_size


def fewest_processes(dp_replicate_size: int, dp_shard_size: int | None, sp_size: int, ep_size: int = 1) -> int:
    """The smallest world the sizes tile (``dp_shard_size`` None: the smallest shard degree that ``ep_size``
    divides together with ``sp_size``)."""
    if dp_shard_size is not None:
        return dp_replicate_size * dp_shard_size * sp_size
    return dp_replicate_size * math.lcm(sp_size, ep_size)

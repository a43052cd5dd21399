"""Per-token conditioning sharded with the tokens (template ``dit/shard_per_token``).

Some DiTs condition each token on its own value, e.g. Wan2.2 TI2V's per-token timesteps (``timestep`` of shape
``(batch, tokens)``: the first frame's tokens at 0, the others at the sampled level), from which the model computes a
per-token modulation (``temb``, ``timestep_proj`` of shape ``(batch, tokens, ...)``). Under SP each rank runs its
blocks on its slice of the tokens, so such a tensor must be sliced the same way (padding included) before the model
derives anything from it; the same tensor in its per-sample form (``(batch,)``) stays whole. Slicing the timestep
rather than its embedding keeps the per-token embedding MLP on this rank's tokens only (it acts per token: exact).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from runtime.diffusion.sp import TokenShard, _pad_and_slice

__all__ = ["shard_per_token"]


def shard_per_token(
    x: Tensor | None, shard: TokenShard | None, dim: int, per_token: Any, site: str = "?"
) -> Tensor | None:
    """This rank's slice of ``x`` along ``dim`` (zero-padded like the tokens) when ``per_token`` holds; ``x`` itself
    when SP is off, ``x`` is None or the tensor is in its per-sample form (``per_token`` false)."""
    if shard is None or x is None or not per_token:
        return x
    if x.size(dim) != shard.tokens:
        raise ValueError(
            f"sequence parallelism ({site}): a per-token tensor of shape {tuple(x.shape)} has {x.size(dim)} entries "
            f"along dim {dim}, but the patchified tokens number {shard.tokens}; it must hold one entry per token"
        )
    return _pad_and_slice(x, shard, dim)

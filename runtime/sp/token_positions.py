"""Absolute token positions read by the model's own code (not through position ids) under SP.

Some attention layers compute a token's position from the length of the tensor they hold: Llama 4's NoPE layers
scale each query by ``log1p(floor((pos + 1) / floor_scale))`` with ``pos = torch.arange(seq_len)``. Under SP a rank
holds 1/sp of the row, so that ``arange`` would restart at 0 on every rank; ``global_token_positions`` moves each
position to the global row index of the token the rank holds (``runtime.sp.layout``: contiguous under Ulysses,
zigzag under a ring). ``pass_position_ids`` hands the forward's global position ids to an attention call its
layer leaves them out of. Both are the identity when SP is off, so the generated model runs upstream's code bitwise.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from runtime.parallel.state import get_parallel_state
from runtime.sp.layout import rank_token_index

__all__ = ["global_token_positions", "pass_position_ids"]


def global_token_positions(local: torch.Tensor) -> torch.Tensor:
    """``local``: positions of this rank's tokens along its last dim as one process would number a row of that
    length (``torch.arange(seq_len)``, plus any offset); returns them shifted to the tokens' global row indices."""
    state = get_parallel_state()
    if not state.sp_enabled:
        return local
    if local.ndim == 0 or local.is_floating_point() or local.is_complex():
        raise ValueError(
            f"sp/global_token_positions wraps integer token positions along the sequence, got a "
            f"{local.dtype} tensor of shape {tuple(local.shape)}"
        )
    length = local.shape[-1]
    index = rank_token_index(length * state.sp_size, state.sp_size, state.ring_size, state.sp_rank)
    shift = index - torch.arange(length)  # global row index minus the local one, per token
    return local + shift.to(device=local.device, dtype=local.dtype)


def pass_position_ids(attention: Callable[..., Any], position_ids: torch.Tensor | None) -> Callable[..., Any]:
    """``attention`` (an attention module's call) given the forward's global ``position_ids`` under SP, for a layer
    that takes them but does not pass them on (Llama 4's decoder layer): ring attention finds the packed documents
    from them. ``attention`` itself when SP is off or the ids are None (upstream's call, bitwise)."""
    if position_ids is None or not get_parallel_state().sp_enabled:
        return attention

    def with_position_ids(*args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("position_ids", position_ids)
        return attention(*args, **kwargs)

    return with_position_ids

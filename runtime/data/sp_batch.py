"""Turn a packed batch into what one SP rank feeds the model.

Position ids are computed on the full row and stay global (RoPE and masks need them); token tensors are
padded to a multiple of sp with a separate padding segment and sliced per rank.
"""

from __future__ import annotations

import torch

from runtime.parallel.collectives import slice_for_rank
from runtime.parallel.state import ParallelState

IGNORE_INDEX = -100
SEQUENCE_KEYS = ("input_ids", "labels")


def pad_to_multiple(batch: dict[str, torch.Tensor], multiple: int, pad_token_id: int = 0) -> dict[str, torch.Tensor]:
    """Append a padding segment (own position ids from 0, labels ignored) so the row length divides `multiple`."""
    pad = -batch["input_ids"].shape[1] % multiple
    if pad == 0:
        return dict(batch)
    rows = batch["input_ids"].shape[0]
    fill = {"input_ids": pad_token_id, "labels": IGNORE_INDEX}
    out = {k: torch.cat([v, torch.full((rows, pad), fill[k], dtype=v.dtype)], 1) for k, v in batch.items()
           if k in fill}
    out["position_ids"] = torch.cat([batch["position_ids"], torch.arange(pad).expand(rows, pad)], 1)
    return out


def shard_for_sp(batch: dict[str, torch.Tensor], state: ParallelState) -> dict[str, torch.Tensor]:
    """This rank's model inputs: its slice of the tokens and labels, the global position ids."""
    padded = pad_to_multiple(batch, state.sp_size)
    local = {k: slice_for_rank(v, 1, state.sp_group) if k in SEQUENCE_KEYS else v for k, v in padded.items()}
    return local

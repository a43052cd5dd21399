"""Per-sample batches of the RL job: a prompt batch repeated into its groups (``repeat_batch``) and the rows of a
micro-batch (``select_rows``). Conditioning dictionaries mix per-sample tensors and lists with shared entries (the
step schedule), so both walk the entries instead of indexing one tensor."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["repeat_batch", "select_rows"]


def repeat_batch(batch: dict[str, Any], repeats: int) -> dict[str, Any]:
    """Each prompt's conditioning repeated ``repeats`` times in place (``[p0, p0, ..., p1, p1, ...]``)."""
    out = {}
    for k, v in batch.items():
        if isinstance(v, torch.Tensor):
            out[k] = v.repeat_interleave(repeats, dim=0)
        elif isinstance(v, list | tuple):
            out[k] = [x for x in v for _ in range(repeats)]
        else:
            out[k] = v
    return out


def select_rows(batch: dict[str, Any], rows: torch.Tensor | Sequence[int]) -> dict[str, Any]:
    """The rows ``rows`` of every per-sample entry (tensors and lists); other entries (the schedule) are shared."""
    idx = torch.as_tensor(rows, dtype=torch.long)
    out = {}
    for k, v in batch.items():
        if isinstance(v, torch.Tensor):
            out[k] = v[idx.to(v.device)]
        elif isinstance(v, list | tuple):
            out[k] = [v[i] for i in idx.tolist()]
        else:
            out[k] = v
    return out

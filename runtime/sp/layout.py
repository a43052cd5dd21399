"""Which tokens of a row each SP rank holds: the one place that decides it (data layer, RoPE slice, labels, ring).

Ulysses only (``ring == 1``): SP rank ``k`` holds the ``k``-th contiguous slice (unchanged, bitwise, from before
rings existed). With a ring, causal attention would load ring rank ``i`` with ``i + 1`` of ``ring`` blocks under
contiguous chunks, so the row is cut **zigzag**: into ``2 * ring`` equal chunks, ring rank ``i`` holding chunks ``i``
and ``2 * ring - 1 - i`` (equal causal work on every rank), and that pair split contiguously over the ``ulysses``
ranks of the ring rank (SP rank ``i * ulysses + j`` holds the ``j``-th part). The Ulysses all-to-all of the ring rank's
group then assembles exactly its zigzag pair. Rows are padded to a multiple of ``pad_multiple`` for it.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["gathered_order", "pad_multiple", "rank_token_index", "to_natural_order", "zigzag_indices"]


def pad_multiple(sp_size: int, ring_size: int) -> int:
    """What a row's length must divide by: ``sp`` (Ulysses only), ``2 * sp`` with a ring (zigzag chunks)."""
    return sp_size if ring_size == 1 else 2 * sp_size


def zigzag_indices(length: int, ring: int, rank: int) -> Tensor:
    """Global token indices of ring rank ``rank`` under zigzag chunking: chunks ``rank`` and ``2*ring-1-rank`` of
    ``2*ring`` equal chunks (``length`` must divide by ``2*ring``)."""
    if length % (2 * ring):
        raise ValueError(f"zigzag chunking needs a length divisible by 2 x ring = {2 * ring}, got {length}")
    chunk = length // (2 * ring)
    first, second = rank * chunk, (2 * ring - 1 - rank) * chunk
    return torch.cat([torch.arange(first, first + chunk), torch.arange(second, second + chunk)])


def rank_token_index(length: int, sp_size: int, ring_size: int, sp_rank: int) -> Tensor:
    """Global indices (ascending within each chunk) of the tokens SP rank ``sp_rank`` holds of a padded row."""
    multiple = pad_multiple(sp_size, ring_size)
    if length % multiple:
        raise ValueError(f"a row of {length} tokens must be padded to a multiple of {multiple}")
    local = length // sp_size
    if ring_size == 1:
        return torch.arange(sp_rank * local, (sp_rank + 1) * local)
    ulysses = sp_size // ring_size
    ring_rank, ulysses_rank = divmod(sp_rank, ulysses)
    return zigzag_indices(length, ring_size, ring_rank)[ulysses_rank * local : (ulysses_rank + 1) * local]


def gathered_order(length: int, sp_size: int, ring_size: int) -> Tensor:
    """The global index of each position of a tensor gathered over SP in rank order."""
    return torch.cat([rank_token_index(length, sp_size, ring_size, r) for r in range(sp_size)])


def to_natural_order(gathered: Tensor, dim: int, sp_size: int, ring_size: int) -> Tensor:
    """A tensor gathered over SP in rank order, put back into the row's token order (identity without a ring)."""
    if ring_size == 1:
        return gathered
    order = gathered_order(gathered.shape[dim], sp_size, ring_size).to(gathered.device)
    return gathered.index_select(dim, torch.argsort(order))

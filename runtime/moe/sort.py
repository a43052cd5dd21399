"""The permutation behind the grouped experts: every (token, slot) pair sorted by the expert it is routed to.

With top-k routing each token ``t`` has ``K`` slots, slot ``(t, k)`` going to expert ``top_k_index[t, k]``. Flattened
to ``S = T * K`` rows and sorted by expert with a *stable* argsort, each expert's rows become one contiguous block
(``counts[e]`` rows, blocks in expert order), so both projections are one grouped matmul over those blocks
(``runtime.moe.grouped``) instead of a gather per expert. Row ``i`` of the sorted layout is flattened slot
``order[i]``, i.e. token ``order[i] // K``; stability keeps the rows of one expert in token order, and since the blocks
are in expert order every token accumulates its experts in ascending order when the rows are scatter-added back,
as the eager reference does.

Expert parallelism: the weights may hold only experts ``[expert_offset, expert_offset + E_local)``; slots routed to
other experts sort past the last local block and are dropped. Counting uses a fixed-size ``index_add`` rather than
``bincount`` (whose output size depends on the data: a graph break under ``torch.compile``); the number of kept
slots costs one host sync unless the caller knows every slot is local (``all_local``).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["sort_by_expert"]


def sort_by_expert(
    top_k_index: Tensor, num_local_experts: int, expert_offset: int = 0, *, all_local: bool = False
) -> tuple[Tensor, Tensor]:
    """Sort the flattened (token, slot) pairs by local expert, dropping slots of non-local experts.

    Returns ``(order, counts)``: ``order`` (S_local,) indexes ``top_k_index.reshape(-1)`` (so ``order // top_k`` is
    the token), stable, so within an expert the rows keep token order; ``counts`` (E_local,) int64 rows per expert.
    ``all_local``: the caller knows every slot is routed to a local expert (all experts local), so nothing is dropped
    and no host sync is needed for the number of kept slots (otherwise one ``int()`` of a device value).
    """
    flat = top_k_index.reshape(-1).long()
    if expert_offset:
        flat = flat - expert_offset
    # Non-local slots become num_local_experts: they sort to the end and fall out of the counts.
    flat = torch.where((flat >= 0) & (flat < num_local_experts), flat, num_local_experts)
    order = torch.argsort(flat, stable=True)
    # A fixed-size count (bincount's output size depends on the data: a graph break under torch.compile).
    counts = torch.zeros(num_local_experts + 1, dtype=torch.long, device=flat.device)
    counts.index_add_(0, flat, torch.ones_like(flat))
    if all_local:
        return order, counts[:num_local_experts]
    kept = int(flat.numel() - counts[num_local_experts])
    return order[:kept], counts[:num_local_experts]

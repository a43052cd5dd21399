"""SP-aware causal-LM loss: token-weighted over the whole sequence, not averaged per rank.

With SP each rank holds a slice of the logits. Labels must be shifted on the *global* sequence (the target of
a rank's last token lives on the next rank), and the mean must be taken over all valid tokens of the group.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from runtime.parallel.collectives import gather_along_dim, reduce_token_weighted_loss, slice_for_rank
from runtime.parallel.state import get_parallel_state

IGNORE_INDEX = -100


def global_shift_labels(labels: torch.Tensor, group: Any, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """This rank's slice of labels shifted left by one over the full sequence (last position ignored)."""
    full = gather_along_dim(labels, 1, group)
    shifted = torch.nn.functional.pad(full, (0, 1), value=ignore_index)[:, 1:]
    return slice_for_rank(shifted, 1, group)


def sp_causal_lm_loss(loss_function: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """`loss_function` itself when SP is off; otherwise a drop-in with the same keyword interface."""
    state = get_parallel_state()
    if not state.sp_enabled:
        return loss_function
    group = state.sp_group

    def loss(logits: torch.Tensor, labels: torch.Tensor | None, vocab_size: int,
             num_items_in_batch: torch.Tensor | int | None = None, ignore_index: int = IGNORE_INDEX,
             shift_labels: torch.Tensor | None = None, **_: Any) -> torch.Tensor:
        if shift_labels is None:
            shift_labels = global_shift_labels(labels, group, ignore_index)
        flat_logits = logits.float().reshape(-1, vocab_size)
        targets = shift_labels.reshape(-1).to(flat_logits.device)
        loss_sum = F.cross_entropy(flat_logits, targets, ignore_index=ignore_index, reduction="sum")
        if num_items_in_batch is None:
            count = (targets != ignore_index).sum()
        else:  # the caller counted tokens over all micro-batches and ranks; spread it so the group sums to it
            count = torch.as_tensor(num_items_in_batch, dtype=torch.float32) / state.sp_size
        return reduce_token_weighted_loss(loss_sum, count, group)

    return loss

"""The causal-LM head and loss of generated models: SP-aware, optionally chunked.

With SP each rank holds a slice of the sequence. Labels must be shifted on the *global* sequence (the target of
a rank's last token lives on the next rank), and the mean must be taken over all valid tokens of the group.
With `loss_chunk_size` set (a keyword argument of the model's forward, like HF's `num_items_in_batch`), the loss
is computed from the hidden states chunk by chunk and full-vocabulary logits are never materialised; the model
then returns `logits=None`. A final-logit softcap (`softcap=`, gemma2/gemma3's `final_logit_softcapping`) is applied
to the logits before the loss in every path, in upstream's op order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from runtime.kernels.cross_entropy import linear_cross_entropy_sum
from runtime.parallel.collectives import gather_along_dim, reduce_token_weighted_loss, slice_for_rank
from runtime.parallel.state import ParallelState, get_parallel_state
from runtime.sp.layout import rank_token_index, to_natural_order

IGNORE_INDEX = -100


def global_shift_labels(labels: torch.Tensor, group: Any, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """This rank's slice of labels shifted left by one over the full sequence (last position ignored); under a ring
    the rank holds zigzag chunks (``runtime.sp.layout``), so the shift happens in the row's token order."""
    state = get_parallel_state()
    full = gather_along_dim(labels, 1, group)
    if state.ring_enabled and group is not None:
        natural = to_natural_order(full, 1, state.sp_size, state.ring_size)
        shifted = F.pad(natural, (0, 1), value=ignore_index)[:, 1:]
        index = rank_token_index(shifted.shape[1], state.sp_size, state.ring_size, state.sp_rank)
        return shifted[:, index.to(shifted.device)]
    shifted = F.pad(full, (0, 1), value=ignore_index)[:, 1:]
    return slice_for_rank(shifted, 1, group)


def _token_weighted(
    loss_sum: torch.Tensor, count: torch.Tensor, num_items_in_batch: Any, state: ParallelState
) -> torch.Tensor:
    """Mean over the SP group's tokens, or over `num_items_in_batch` tokens counted by the caller."""
    if num_items_in_batch is not None:  # counted over all micro-batches and ranks: spread so the group sums to it
        count = torch.as_tensor(num_items_in_batch, dtype=torch.float32) / state.sp_size
    return reduce_token_weighted_loss(loss_sum, count, state.sp_group)


def sp_causal_lm_loss(loss_function: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """`loss_function` itself when SP is off; otherwise a drop-in with the same keyword interface."""
    state = get_parallel_state()
    if not state.sp_enabled:
        return loss_function

    def loss(
        logits: torch.Tensor,
        labels: torch.Tensor | None,
        vocab_size: int,
        num_items_in_batch: torch.Tensor | int | None = None,
        ignore_index: int = IGNORE_INDEX,
        shift_labels: torch.Tensor | None = None,
        **_: Any,
    ) -> torch.Tensor:
        if shift_labels is None:
            shift_labels = global_shift_labels(labels, state.sp_group, ignore_index)
        targets = shift_labels.reshape(-1).to(logits.device)
        loss_sum = F.cross_entropy(
            logits.float().reshape(-1, vocab_size), targets, ignore_index=ignore_index, reduction="sum"
        )
        return _token_weighted(loss_sum, (targets != ignore_index).sum(), num_items_in_batch, state)

    return loss


def apply_softcap(logits: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """Upstream's final-logit softcap (`logits / cap`, `tanh`, `* cap`: the same ops in the same order, so the
    result is bitwise upstream's); the logits themselves without a cap."""
    if softcap is None:
        return logits
    logits = logits / softcap
    logits = torch.tanh(logits)
    return logits * softcap


def causal_lm_logits_and_loss(
    lm_head: torch.nn.Module,
    hidden_states: torch.Tensor,
    labels: torch.Tensor | None,
    loss_function: Callable[..., torch.Tensor],
    vocab_size: int,
    loss_chunk_size: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
):
    """(logits, loss) exactly as upstream computes them unless SP is on or `loss_chunk_size` is given; `softcap`
    (the model's final-logit softcap, None: none) is applied to the logits before the loss in every path."""
    if loss_chunk_size is None or labels is None:
        logits = apply_softcap(lm_head(hidden_states), softcap)
        if labels is None:
            return logits, None
        return logits, sp_causal_lm_loss(loss_function)(logits=logits, labels=labels, vocab_size=vocab_size, **kwargs)
    state = get_parallel_state()
    shift_labels = kwargs.get("shift_labels")
    if shift_labels is None:
        shift_labels = (
            global_shift_labels(labels, state.sp_group)
            if state.sp_enabled
            else F.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:]
        )
    loss_sum, count = linear_cross_entropy_sum(
        hidden_states,
        lm_head.weight,
        shift_labels,
        bias=getattr(lm_head, "bias", None),
        chunk_size=loss_chunk_size,
        softcap=softcap,
    )
    return None, _token_weighted(loss_sum, count, kwargs.get("num_items_in_batch"), state)

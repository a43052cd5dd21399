"""MoE hooks that generated modeling files call; each is the identity when nothing is parallel."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from runtime.parallel.state import get_parallel_state


def global_aux_loss(
    loss_func: Callable[..., torch.Tensor], token_mask: torch.Tensor | None = None
) -> Callable[..., torch.Tensor]:
    """Upstream's load-balancing loss, or, with several ranks holding different tokens or with padding tokens marked,
    its global version.

    Under data/sequence parallelism each rank routes only its own tokens; the balance term must be computed from
    all of them (token fractions and mean router probabilities over the global token set). ``token_mask`` is this
    rank's ``(bs, L)`` mask of real tokens, which the SP collator (``runtime.data.sp_batch.shard_row``) passes as the
    model's ``token_mask`` keyword: the padding segment it appends to make a row divide by sp is routed like any
    token (the experts see it) but counts in neither the token fractions nor the mean probabilities, so the loss is
    the unpadded single-process one. Upstream's function is returned unchanged when neither applies.
    """
    state = get_parallel_state()
    distributed = state.loss_group is not None and state.world_size > 1
    if not distributed and token_mask is None:
        return loss_func
    group = state.loss_group if distributed else None

    def global_loss(
        gate_logits: Any, num_experts: int | None = None, top_k: int = 2, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        from runtime.moe.aux_loss import global_load_balancing_loss

        if attention_mask is not None:
            raise ValueError(
                "the global load-balancing loss expects packed rows without a padding attention mask "
                "(mark padding with token_mask instead)"
            )
        return global_load_balancing_loss(gate_logits, top_k, num_experts, group, token_mask=token_mask)

    return global_loss

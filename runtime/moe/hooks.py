"""MoE hooks that generated modeling files call; each is the identity when nothing is parallel."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from runtime.parallel.state import get_parallel_state


def global_aux_loss(loss_func: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """Upstream's load-balancing loss, or, with several ranks holding different tokens, its global version.

    Under data/sequence parallelism each rank routes only its own tokens; the balance term must be computed from
    all of them (token fractions and mean router probabilities over the global token set).
    """
    state = get_parallel_state()
    if state.loss_group is None or state.world_size == 1:
        return loss_func

    def global_loss(
        gate_logits: Any, num_experts: int | None = None, top_k: int = 2, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        from runtime.moe.aux_loss import global_load_balancing_loss

        if attention_mask is not None:
            raise ValueError("the global load-balancing loss expects packed rows without a padding attention mask")
        return global_load_balancing_loss(gate_logits, top_k, num_experts, state.loss_group)

    return global_loss

"""The Switch / Qwen load-balancing loss over the *global* token set of a process group.

transformers' ``load_balancing_loss_func`` computes, over the rows of the concatenated router logits (all layers),

    loss = E * sum_{k, e} f[k, e] * P[e],   f = mean over rows of one_hot(top-k experts)   (K, E)
                                              P = mean over rows of softmax(logits)           (E,)

Computed per rank, f and P describe that rank's tokens only, and the loss no longer penalises a global imbalance.
``global_load_balancing_loss`` all-reduces the three sums behind the means (the top-k counts, the summed router
probabilities and the row count) and returns, on every rank, the loss of the concatenation of all ranks' logits.

Gradient (partial-gradient convention, see ``docs/parallelism.md``): the loss is differentiable only through P, and
the all-reduce of the probability sums has an identity backward, so each rank's backward yields the derivative of
the global loss with respect to *its own* logits; summed over the group (as the data-parallel gradient reduction
does for the replicated router weights) that is the gradient of the global loss. The value is the same global loss
on every rank, so do not sum it over ranks for reporting.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.distributed import ProcessGroup

__all__ = ["global_load_balancing_loss"]


class _SumNoBackwardComm(torch.autograd.Function):
    """All-reduce (sum) forward; identity backward (each rank differentiates only its own contribution)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: ProcessGroup) -> Tensor:
        out = x.clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


def global_load_balancing_loss(
    router_logits: Tensor | Sequence[Tensor],
    top_k: int,
    num_experts: int,
    group: ProcessGroup | None = None,
    token_mask: Tensor | None = None,
) -> Tensor:
    """Load-balancing loss of all ranks' tokens in ``group`` (None: this process only), as a scalar on every rank.

    ``router_logits``: ``(T, E)``, or one ``(T, E)`` tensor per layer (concatenated, as transformers does).
    ``token_mask``: optional ``(T,)`` (or any shape with T elements) marking the real tokens; padding rows count
    nowhere, in every layer — transformers' ``attention_mask`` argument. Equals ``load_balancing_loss_func`` on the
    concatenation of every rank's logits; with no row anywhere the loss is 0 (with a zero gradient), never NaN.
    """
    layers = [router_logits] if isinstance(router_logits, Tensor) else list(router_logits)
    if not layers:
        raise ValueError("global_load_balancing_loss: no router logits")
    for logits in layers:
        if logits.dim() != 2 or logits.size(1) != num_experts or logits.shape != layers[0].shape:
            raise ValueError(
                f"global_load_balancing_loss: every layer's router logits must be (tokens, num_experts={num_experts})"
                f" with the same shape; got {[tuple(t.shape) for t in layers]}"
            )
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"global_load_balancing_loss: top_k={top_k} must be in [1, num_experts={num_experts}]")
    device = layers[0].device
    logits = torch.cat([t.to(device) for t in layers], dim=0)
    probs = F.softmax(logits, dim=-1)
    # Counts are exact in float64 (fp32 stops at 2**24 rows); probabilities are summed in at least fp32.
    acc_dtype = torch.promote_types(probs.dtype, torch.float32)
    with torch.no_grad():
        selected = torch.topk(probs, top_k, dim=-1).indices
        expert_mask = F.one_hot(selected, num_experts).to(torch.float64)  # (rows, K, E)
        if token_mask is None:
            row_weight = None
            rows = torch.tensor(float(logits.size(0)), dtype=torch.float64, device=device)
        else:
            token_mask = token_mask.reshape(-1).to(device)
            if token_mask.numel() != layers[0].size(0):
                raise ValueError(
                    f"global_load_balancing_loss: token_mask has {token_mask.numel()} elements for "
                    f"{layers[0].size(0)} tokens per layer"
                )
            row_weight = (token_mask != 0).repeat(len(layers))
            rows = row_weight.sum(dtype=torch.float64)
            expert_mask = expert_mask * row_weight[:, None, None]
        counts = torch.cat([expert_mask.sum(0).reshape(-1), rows.reshape(1)])
        if group is not None:
            dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=group)
        # clamp_min: with no rows anywhere every sum is 0 and so is the loss (0 / 1, never 0 / 0).
        total_rows = counts[-1].clamp_min(1)
        tokens_per_expert = (counts[:-1] / total_rows).view(top_k, num_experts).to(acc_dtype)
    if row_weight is not None:
        probs = probs * row_weight[:, None].to(probs.dtype)
    prob_sum = probs.sum(0, dtype=acc_dtype)
    if group is not None:
        prob_sum = _SumNoBackwardComm.apply(prob_sum, group)
    router_prob_per_expert = prob_sum / total_rows.to(acc_dtype)
    return torch.sum(tokens_per_expert * router_prob_per_expert.unsqueeze(0)) * num_experts

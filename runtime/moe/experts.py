"""Routed MoE experts behind one function, ``experts_forward``, with an eager reference and fast grouped paths.

Weights are stacked like transformers' ``Qwen3MoeExperts``: ``gate_up_proj`` is ``(E, 2I, H)`` (gate rows first,
then up rows) and ``down_proj`` is ``(E, H, I)``; expert ``e`` computes
``down_proj[e] @ (act(gate_up_proj[e][:I] @ x) * gate_up_proj[e][I:] @ x)``, and a token's output is the sum over
its top-k slots of ``routing weight * expert output``.

Implementations (``impl=``):

* ``"eager"`` — the numerical reference: transformers' per-expert loop, op for op, so forward and backward are
  **bitwise** equal to ``Qwen3MoeExperts.forward`` (tested against the real module).
* ``"grouped"`` — every (token, slot) pair is sorted by expert (``runtime.moe.sort``), so each expert's rows are one
  contiguous block; both projections are grouped matmuls over those blocks (``runtime.moe.grouped``: the
  ``torch._grouped_mm`` / ``segment`` / ``bmm`` backends, chosen per call by measurement, their figures and why the
  backward is faster than eager's), with the fused SiLU gate between them (``runtime.moe.activation``); then the
  rows are scaled by their routing weights and scatter-added (``index_add``) back to their tokens
  (``experts_from_sorted``).
* ``"triton"`` — the same sorted layout with a Triton grouped-GEMM kernel (``runtime.kernels.moe_triton``); CUDA
  only, imported lazily (the tests run it on CPU tensors under Triton's interpreter, ``TRITON_INTERPRET=1``).

``expert_offset``: the weights may hold only experts ``[expert_offset, expert_offset + E_local)`` (expert
parallelism); ``top_k_index`` holds global ids and slots routed to other experts contribute nothing.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from runtime.moe.activation import gated_activation
from runtime.moe.grouped import grouped_linear
from runtime.moe.sort import sort_by_expert

__all__ = ["IMPLS", "experts_forward", "experts_from_sorted"]

IMPLS = ("eager", "grouped", "triton")


def _check_inputs(
    hidden: Tensor, top_k_index: Tensor, top_k_weights: Tensor, gate_up_proj: Tensor, down_proj: Tensor
) -> None:
    if hidden.dim() != 2:
        raise ValueError(f"experts_forward: hidden must be (tokens, hidden), got shape {tuple(hidden.shape)}")
    if top_k_index.dim() != 2 or top_k_index.shape != top_k_weights.shape or top_k_index.size(0) != hidden.size(0):
        raise ValueError(
            f"experts_forward: top_k_index {tuple(top_k_index.shape)} and top_k_weights {tuple(top_k_weights.shape)} "
            f"must both be (tokens={hidden.size(0)}, top_k)"
        )
    if top_k_index.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"experts_forward: top_k_index must be an integer tensor, got {top_k_index.dtype}")
    if gate_up_proj.dim() != 3 or down_proj.dim() != 3:
        raise ValueError("experts_forward: gate_up_proj must be (E, 2I, H) and down_proj (E, H, I)")
    experts, two_i, h = gate_up_proj.shape
    if h != hidden.size(1) or two_i % 2 or down_proj.shape != (experts, h, two_i // 2):
        raise ValueError(
            f"experts_forward: gate_up_proj {tuple(gate_up_proj.shape)} must be (E, 2I, H) and down_proj "
            f"{tuple(down_proj.shape)} (E, H, I) with H = hidden size {hidden.size(1)}"
        )


# --- eager reference ------------------------------------------------------------------------------------------------


def _eager(
    hidden: Tensor,
    top_k_index: Tensor,
    top_k_weights: Tensor,
    gate_up_proj: Tensor,
    down_proj: Tensor,
    act_fn: Callable[[Tensor], Tensor],
    expert_offset: int,
) -> Tensor:
    num_experts = gate_up_proj.size(0)
    final_hidden_states = torch.zeros_like(hidden)
    with torch.no_grad():
        top_k_index = top_k_index.long()  # one_hot takes int64 only; a no-op (same tensor) for int64
        local_index = top_k_index - expert_offset if expert_offset else top_k_index
        outside = (local_index < 0) | (local_index >= num_experts)
        num_classes = num_experts
        if bool(outside.any()):
            # Slots owned by other ranks go to one extra class, which the loop skips (transformers' EP sentinel).
            local_index = local_index.masked_fill(outside, num_experts)
            num_classes = num_experts + 1
        expert_mask = F.one_hot(local_index, num_classes=num_classes)
        expert_mask = expert_mask.permute(2, 1, 0)
        expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()

    # The loop body is transformers' Qwen3MoeExperts.forward, statement for statement (bitwise parity).
    for expert_idx in expert_hit:
        expert_idx = expert_idx[0]
        if expert_idx == num_experts:
            continue
        top_k_pos, token_idx = torch.where(expert_mask[expert_idx])
        current_state = hidden[token_idx]
        gate, up = F.linear(current_state, gate_up_proj[expert_idx]).chunk(2, dim=-1)
        current_hidden_states = act_fn(gate) * up
        current_hidden_states = F.linear(current_hidden_states, down_proj[expert_idx])
        current_hidden_states = current_hidden_states * top_k_weights[token_idx, top_k_pos, None]
        final_hidden_states.index_add_(0, token_idx, current_hidden_states.to(final_hidden_states.dtype))
    return final_hidden_states


# --- grouped experts over sorted rows -------------------------------------------------------------------------------


def _grouped(
    hidden: Tensor,
    top_k_index: Tensor,
    top_k_weights: Tensor,
    gate_up_proj: Tensor,
    down_proj: Tensor,
    act_fn: Callable[[Tensor], Tensor],
    expert_offset: int,
    linear: Callable[..., Tensor],
    all_local: bool = False,
) -> Tensor:
    top_k = top_k_index.size(1)
    with torch.no_grad():
        order, counts = sort_by_expert(top_k_index, gate_up_proj.size(0), expert_offset, all_local=all_local)
        token_idx = torch.div(order, top_k, rounding_mode="floor")
    return experts_from_sorted(
        hidden, order, token_idx, counts, top_k_weights, gate_up_proj, down_proj, act_fn, linear
    )


def experts_from_sorted(
    hidden: Tensor,
    order: Tensor,
    token_idx: Tensor,
    counts: Tensor,
    top_k_weights: Tensor,
    gate_up_proj: Tensor,
    down_proj: Tensor,
    act_fn: Callable[[Tensor], Tensor],
    linear: Callable[..., Tensor],
) -> Tensor:
    """The grouped experts once the (token, slot) pairs are sorted (``sort_by_expert``): ``order`` indexes the
    flattened slots, ``token_idx`` their tokens, ``counts`` the rows per local expert; ``linear(x, weight, counts)``
    is the grouped matmul. Also what ``runtime.plan`` runs on fake tensors with a balanced routing."""
    current_state = hidden.index_select(0, token_idx)
    current_hidden_states = linear(
        gated_activation(linear(current_state, gate_up_proj, counts), act_fn), down_proj, counts
    )
    weights = top_k_weights.reshape(-1).index_select(0, order)
    current_hidden_states = current_hidden_states * weights[:, None]
    # Rows are in expert order, so every token accumulates its experts in ascending order, as eager does.
    return torch.zeros_like(hidden).index_add(0, token_idx, current_hidden_states.to(hidden.dtype))


def experts_forward(
    hidden: Tensor,
    top_k_index: Tensor,
    top_k_weights: Tensor,
    gate_up_proj: Tensor,
    down_proj: Tensor,
    act_fn: Callable[[Tensor], Tensor],
    impl: str = "eager",
    expert_offset: int = 0,
    *,
    backend: str | None = None,
    num_experts: int | None = None,
) -> Tensor:
    """Routed experts: ``(T, H)`` tokens, ``(T, K)`` global expert ids and weights -> ``(T, H)``.

    ``gate_up_proj`` (E_local, 2I, H) and ``down_proj`` (E_local, H, I) hold experts
    ``[expert_offset, expert_offset + E_local)``; slots routed elsewhere are ignored. ``impl`` is one of ``IMPLS``
    (see the module docstring); ``backend`` forces a grouped-matmul backend for ``impl="grouped"``.
    ``num_experts``: the router's expert count, when known; if these weights hold all of them (``expert_offset`` 0,
    ``E_local == num_experts``), every slot is local and the grouped paths sort without a host sync.
    """
    _check_inputs(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj)
    all_local = expert_offset == 0 and num_experts == gate_up_proj.size(0)
    if impl == "eager":
        return _eager(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, act_fn, expert_offset)
    if impl == "grouped":

        def linear(x: Tensor, w: Tensor, counts: Tensor) -> Tensor:
            return grouped_linear(x, w, counts, backend)

        return _grouped(
            hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, act_fn, expert_offset, linear, all_local
        )
    if impl == "triton":
        from runtime.kernels.moe_triton import triton_grouped_linear, triton_unavailable_reason

        reason = triton_unavailable_reason(hidden)
        if reason is not None:
            raise RuntimeError(f"experts_forward(impl='triton'): {reason}")
        return _grouped(
            hidden,
            top_k_index,
            top_k_weights,
            gate_up_proj,
            down_proj,
            act_fn,
            expert_offset,
            triton_grouped_linear,
            all_local,
        )
    raise ValueError(f"experts_forward: unknown impl {impl!r}; expected one of {IMPLS}")

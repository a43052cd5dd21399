"""Expert parallelism: token copies travel to the rank that owns their expert and back, by uneven all-to-alls.

With ``E`` experts over an EP group of ``ep`` ranks, group rank ``r`` owns experts ``[r*E/ep, (r+1)*E/ep)``
(contiguous, so "sorted by expert" is also "sorted by destination rank"). ``ep_experts_forward``:

1. sorts this rank's (token, slot) pairs by expert (stable) and counts them per expert;
2. exchanges the per-expert counts with one equal-split all-to-all (``E/ep`` numbers to each rank), which gives the
   uneven send and receive splits (two host syncs, ``.tolist()`` of each: the only ones of the EP path; a graph break
   each under torch.compile);
3. all-to-alls the token copies; what arrives is ordered by source rank, then by local expert;
4. runs the local experts on the arrivals (``experts_forward`` with one slot per row and weight 1, which is exact);
5. all-to-alls the results back with the splits swapped, scales them by the routing weights *on the source rank*
   (so the routing weights' gradient never leaves it) and scatter-adds them into the tokens.

Both all-to-alls are autograd functions whose backward is the all-to-all with swapped splits. Zero tokens for an
expert, from a rank, to a rank, or on a rank at all are ordinary cases (zero-length splits, empty tensors); every
rank must still call ``ep_experts_forward`` (and run backward) together, as with any collective.

Gradient convention: the local expert weights are not replicated across the EP group, so the gradient a rank gets
for them is complete for the tokens of the whole EP group (sum it over the *other* data-parallel dims only, i.e.
``ParallelState.expert_fsdp_mesh``); token gradients flow back to their source rank, like the Ulysses all-to-alls in
``runtime.parallel.collectives``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from runtime.moe.experts import experts_forward
from runtime.moe.sort import sort_by_expert

__all__ = ["all_to_all_uneven", "ep_experts_forward", "local_expert_range"]


def local_expert_range(num_experts: int, ep_size: int, ep_rank: int) -> tuple[int, int]:
    """``[start, stop)`` of the experts EP rank ``ep_rank`` owns; a ``ValueError`` unless ``ep_size`` divides E."""
    if ep_size < 1 or not 0 <= ep_rank < ep_size:
        raise ValueError(f"invalid EP layout: ep_size={ep_size}, ep_rank={ep_rank}")
    if num_experts % ep_size:
        raise ValueError(
            f"expert parallelism needs the number of experts ({num_experts}) to be divisible by the EP size "
            f"({ep_size}): each EP rank owns an equal contiguous range of experts"
        )
    per_rank = num_experts // ep_size
    return ep_rank * per_rank, (ep_rank + 1) * per_rank


def _all_to_all(x: Tensor, send_splits: list[int], recv_splits: list[int], group: ProcessGroup) -> Tensor:
    x = x.contiguous()
    out = x.new_empty((sum(recv_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x, output_split_sizes=recv_splits, input_split_sizes=send_splits, group=group)
    return out


class _AllToAllUneven(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, send_splits: list[int], recv_splits: list[int], group: ProcessGroup) -> Tensor:
        ctx.send_splits, ctx.recv_splits, ctx.group = send_splits, recv_splits, group
        return _all_to_all(x, send_splits, recv_splits, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        return _all_to_all(grad, ctx.recv_splits, ctx.send_splits, ctx.group), None, None, None


def all_to_all_uneven(x: Tensor, send_splits: list[int], recv_splits: list[int], group: ProcessGroup | None) -> Tensor:
    """Send rows ``[sum(send_splits[:j]), ...+send_splits[j])`` of ``x`` to group rank ``j``; arrivals by rank.

    ``recv_splits[j]`` rows come from rank ``j``. Differentiable: backward is the all-to-all with swapped splits.
    ``group=None`` is a group of one (``x`` is returned as is).
    """
    if group is None:
        return x
    return _AllToAllUneven.apply(x, list(send_splits), list(recv_splits), group)


def ep_experts_forward(
    hidden: Tensor,
    top_k_index: Tensor,
    top_k_weights: Tensor,
    local_gate_up: Tensor,
    local_down: Tensor,
    act_fn: Callable[[Tensor], Tensor],
    num_experts: int,
    group: ProcessGroup | None,
    impl: str = "grouped",
    compute: Callable[[Tensor, Tensor, Tensor], Tensor] | None = None,
) -> Tensor:
    """Routed experts with the experts sharded over ``group`` (the EP group): ``(T, H)`` -> ``(T, H)``.

    ``top_k_index`` holds global expert ids; ``local_gate_up`` (E/ep, 2I, H) and ``local_down`` (E/ep, H, I) are
    this rank's experts. ``impl`` is the local ``experts_forward`` implementation; ``compute`` (``(hidden,
    local_ids, weights) -> out``), when given, replaces it: the experts module's own layout (biases, interleaved or
    transposed weights, its own gate; ``runtime.moe.dispatch``'s ``patchgen_eager``). ``group=None`` runs all
    ``num_experts`` experts locally.
    """
    ep_size = 1 if group is None else dist.get_world_size(group)
    ep_rank = 0 if group is None else dist.get_rank(group)
    first, stop = local_expert_range(num_experts, ep_size, ep_rank)
    per_rank = stop - first
    if local_gate_up.size(0) != per_rank or local_down.size(0) != per_rank:
        raise ValueError(
            f"ep_experts_forward: EP rank {ep_rank} of {ep_size} owns {per_rank} of {num_experts} experts, but the "
            f"local weights hold {local_gate_up.size(0)} (gate_up) and {local_down.size(0)} (down)"
        )
    if top_k_index.dim() != 2 or top_k_index.shape != top_k_weights.shape or top_k_index.size(0) != hidden.size(0):
        raise ValueError(
            f"ep_experts_forward: top_k_index {tuple(top_k_index.shape)} and top_k_weights "
            f"{tuple(top_k_weights.shape)} must both be (tokens={hidden.size(0)}, top_k)"
        )
    if group is None:
        if compute is not None:
            return compute(hidden, top_k_index, top_k_weights)
        return experts_forward(
            hidden, top_k_index, top_k_weights, local_gate_up, local_down, act_fn, impl, num_experts=num_experts
        )

    top_k = top_k_index.size(1)
    with torch.no_grad():
        # Ids outside [0, E) are counted nowhere: the send splits (needed on the host anyway) fall short of the slots.
        order, counts = sort_by_expert(top_k_index, num_experts, all_local=True)
        send_splits = counts.view(ep_size, per_rank).sum(1).tolist()
        if sum(send_splits) != top_k_index.numel():
            raise ValueError(f"ep_experts_forward: top_k_index holds expert ids outside [0, {num_experts})")
        token_idx = torch.div(order, top_k, rounding_mode="floor")
        # recv_counts[s, j]: rows source rank s sends for my local expert j.
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts, group=group)
        recv_counts = recv_counts.view(ep_size, per_rank)
        recv_splits = recv_counts.sum(1).tolist()
        local_ids = torch.repeat_interleave(
            torch.arange(per_rank, device=counts.device).repeat(ep_size),
            recv_counts.reshape(-1),
            output_size=sum(recv_splits),
        )

    dispatched = all_to_all_uneven(hidden.index_select(0, token_idx), send_splits, recv_splits, group)
    ones = torch.ones(dispatched.size(0), 1, dtype=top_k_weights.dtype, device=hidden.device)
    if compute is not None:
        expert_out = compute(dispatched, local_ids[:, None], ones)
    else:
        expert_out = experts_forward(
            dispatched, local_ids[:, None], ones, local_gate_up, local_down, act_fn, impl, num_experts=per_rank
        )
    returned = all_to_all_uneven(expert_out, recv_splits, send_splits, group)
    weighted = returned * top_k_weights.reshape(-1).index_select(0, order)[:, None]
    return torch.zeros_like(hidden).index_add(0, token_idx, weighted.to(hidden.dtype))

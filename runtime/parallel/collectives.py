"""Sequence-parallel collectives with hand-written backward passes.

Every function takes an explicit ``group``. ``group=None`` means a group of one: no communication, and the function
returns its input (or does only the local part of its job), so single-process code paths cost nothing.

Gradient convention
-------------------
Each rank's backward produces its *partial* gradient: the derivative of the loss terms computed on that rank only.
The true gradient of anything replicated across the SP group (the parameters, a tensor before ``slice_for_rank``)
is the SUM of the partial gradients over the group, taken once by whoever reduces gradients (e.g. the data-parallel
all-reduce spanning SP ranks too). Hence:

* ``slice_for_rank``: replicated -> local. Backward zero-pads the local gradient; no communication.
* ``gather_along_dim``: local -> replicated. Backward sums the partial gradients of the full tensor over the group
  and keeps this rank's chunk (reduce-scatter): the chunk lives on this rank only, so its gradient must be complete.
* The Ulysses all-to-alls move every element to exactly one rank; their backward is the inverse all-to-all. The
  ``_many`` forms exchange several tensors (q, k and v) in one all-to-all: one collective where there were three,
  whose latency, not its bytes, is what small shards pay; the elements land exactly where one all-to-all each would
  put them (bitwise the same results).
* ``reduce_token_weighted_loss``: the forward all-reduces, the backward does not communicate: ``d loss / d loss_sum``
  is the same ``1 / global_count`` on every rank, and each rank differentiates only its own ``loss_sum``.

A tensor is split along a dim into ``group size`` equal contiguous chunks, chunk ``i`` belonging to group rank ``i``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.distributed import ProcessGroup

__all__ = [
    "gather_along_dim",
    "gather_heads_scatter_seq",
    "gather_heads_scatter_seq_many",
    "gather_seq_scatter_heads",
    "gather_seq_scatter_heads_many",
    "pad_and_slice",
    "reduce_token_weighted_loss",
    "slice_for_rank",
    "unpad",
]


def _size_and_rank(group: ProcessGroup | None) -> tuple[int, int]:
    if group is None:
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def _check_divisible(x: Tensor, dim: int, parts: int, what: str) -> None:
    if x.size(dim) % parts:
        raise ValueError(
            f"{what}: dim {dim} of a tensor of shape {tuple(x.shape)} has size {x.size(dim)}, "
            f"which is not divisible by the SP group size {parts}"
        )


def _all_gather(x: Tensor, dim: int, group: ProcessGroup, size: int) -> Tensor:
    # The flat collectives concatenate along dim 0 of contiguous buffers; move `dim` there and back.
    front = x.movedim(dim, 0).contiguous()
    out = front.new_empty((front.size(0) * size, *front.shape[1:]))
    dist.all_gather_single(out, front, group=group)
    return out.movedim(0, dim)


def _reduce_scatter(x: Tensor, dim: int, group: ProcessGroup, size: int) -> Tensor:
    front = x.movedim(dim, 0).contiguous()
    out = front.new_empty((front.size(0) // size, *front.shape[1:]))
    dist.reduce_scatter_single(out, front, op=dist.ReduceOp.SUM, group=group)
    return out.movedim(0, dim)


def _all_to_all(x: Tensor, scatter_dim: int, gather_dim: int, group: ProcessGroup, size: int) -> Tensor:
    """Send chunk ``j`` of ``scatter_dim`` to rank ``j``; concatenate the arrivals along ``gather_dim`` by rank."""
    send = torch.stack(x.chunk(size, dim=scatter_dim)).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return torch.cat(recv.unbind(0), dim=gather_dim)


def _all_to_all_many(
    xs: tuple[Tensor, ...], scatter_dim: int, gather_dim: int, group: ProcessGroup, size: int
) -> tuple[Tensor, ...]:
    """``_all_to_all`` of each tensor (one dtype and device), in one collective: row ``j`` of the send buffer holds
    chunk ``j`` of every tensor, flattened side by side, so each element reaches the rank and place it would alone."""
    chunks = [x.unflatten(scatter_dim, (size, -1)).movedim(scatter_dim, 0) for x in xs]  # (size, *chunk) each
    widths = [chunk[0].numel() for chunk in chunks]
    send = xs[0].new_empty((size, sum(widths)))
    for part, chunk in zip(send.split(widths, dim=1), chunks, strict=True):
        part.view(chunk.shape).copy_(chunk)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    parts = zip(recv.split(widths, dim=1), chunks, strict=True)
    return tuple(torch.cat(part.view(chunk.shape).unbind(0), dim=gather_dim) for part, chunk in parts)


class _SliceForRank(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, dim: int, size: int, rank: int) -> Tensor:
        ctx.dim, ctx.size, ctx.rank, ctx.full = dim, size, rank, x.size(dim)
        # A copy, not a view of the input: in-place ops on the chunk must not reach the caller's full tensor.
        chunk = x.size(dim) // size
        return x.narrow(dim, rank * chunk, chunk).clone(memory_format=torch.contiguous_format)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        shape = list(grad.shape)
        shape[ctx.dim] = ctx.full
        full = grad.new_zeros(shape)
        full.narrow(ctx.dim, ctx.rank * grad.size(ctx.dim), grad.size(ctx.dim)).copy_(grad)
        return full, None, None, None


class _GatherAlongDim(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, dim: int, group: ProcessGroup, size: int) -> Tensor:
        ctx.dim, ctx.group, ctx.size = dim, group, size
        return _all_gather(x, dim, group, size)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        return _reduce_scatter(grad, ctx.dim, ctx.group, ctx.size), None, None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, scatter_dim: int, gather_dim: int, group: ProcessGroup, size: int) -> Tensor:
        ctx.scatter_dim, ctx.gather_dim, ctx.group, ctx.size = scatter_dim, gather_dim, group, size
        return _all_to_all(x, scatter_dim, gather_dim, group, size)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None, None]:
        return _all_to_all(grad, ctx.gather_dim, ctx.scatter_dim, ctx.group, ctx.size), None, None, None, None


class _FusedAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, scatter_dim: int, gather_dim: int, group: ProcessGroup, size: int, *xs: Tensor) -> Any:
        ctx.scatter_dim, ctx.gather_dim, ctx.group, ctx.size = scatter_dim, gather_dim, group, size
        return _all_to_all_many(xs, scatter_dim, gather_dim, group, size)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> Any:
        back = _all_to_all_many(grads, ctx.gather_dim, ctx.scatter_dim, ctx.group, ctx.size)
        return (None, None, None, None, *back)


class _TokenWeightedMean(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, loss_sum: Tensor, token_count: Tensor, group: ProcessGroup | None) -> Tensor:
        # One all-reduce carries both numbers; float64 keeps token counts exact far beyond fp32's 2**24.
        totals = torch.stack([loss_sum.detach().double(), token_count.detach().to(loss_sum.device).double()])
        if group is not None:
            dist.all_reduce(totals, op=dist.ReduceOp.SUM, group=group)
        global_sum, global_count = totals.unbind(0)
        # torch.where rather than an `if` on the count: no host sync on GPU.
        has_tokens = global_count > 0
        inv_count = torch.where(has_tokens, 1.0 / global_count.clamp_min(1), 0.0)
        ctx.save_for_backward(inv_count.to(loss_sum.dtype))
        mean = global_sum / global_count.clamp_min(1)
        return torch.where(has_tokens, mean, loss_sum.detach().double() * 0).to(loss_sum.dtype)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        (inv_count,) = ctx.saved_tensors
        return grad * inv_count, None, None


def slice_for_rank(x: Tensor, dim: int, group: ProcessGroup | None) -> Tensor:
    """This rank's contiguous chunk of a tensor replicated over ``group`` (e.g. the sequence of a batch).

    Backward returns the gradient zero-padded to the full size: this rank's partial gradient.
    """
    size, rank = _size_and_rank(group)
    if size == 1:
        return x
    _check_divisible(x, dim, size, "slice_for_rank")
    return _SliceForRank.apply(x, dim % x.dim(), size, rank)


def gather_along_dim(x: Tensor, dim: int, group: ProcessGroup | None) -> Tensor:
    """Concatenate every rank's chunk along ``dim`` (all ranks must pass the same shape).

    Backward reduce-scatters (sums) the partial gradients so each rank gets the full gradient of its own chunk.
    """
    size, _ = _size_and_rank(group)
    if size == 1:
        return x
    return _GatherAlongDim.apply(x, dim % x.dim(), group, size)


def pad_and_slice(
    x: Tensor, dim: int, group: ProcessGroup | None, multiple: int = 1, value: float = 0.0
) -> tuple[Tensor, int]:
    """Pad ``dim`` with ``value`` up to a multiple of ``group size * multiple``, then take this rank's chunk.

    Returns ``(local, pad_len)``; ``unpad(gather_along_dim(local, ...), dim, pad_len)`` restores the full length.
    ``multiple`` lets each rank's chunk meet a kernel's alignment; with ``group=None`` only that padding happens.
    The padding lands at the end, so the last rank(s) may hold nothing but padding.
    """
    if multiple < 1:
        raise ValueError(f"pad_and_slice: multiple must be >= 1, got {multiple}")
    size, _ = _size_and_rank(group)
    pad_len = -x.size(dim) % (size * multiple)
    if pad_len:
        dim = dim % x.dim()
        # F.pad lists (left, right) pairs starting from the last dim.
        x = F.pad(x, [0, 0] * (x.dim() - 1 - dim) + [0, pad_len], value=value)
    return slice_for_rank(x, dim, group), pad_len


def unpad(x: Tensor, dim: int, pad_len: int) -> Tensor:
    """Drop the last ``pad_len`` entries along ``dim`` (the padding added by ``pad_and_slice``)."""
    if pad_len == 0:
        return x
    return x.narrow(dim, 0, x.size(dim) - pad_len)


def gather_seq_scatter_heads(x: Tensor, seq_dim: int, head_dim: int, group: ProcessGroup | None) -> Tensor:
    """Ulysses all-to-all before attention: local sequence chunk x all heads -> full sequence x this rank's heads.

    Rank ``r`` receives the contiguous head chunk ``r``. Backward is the inverse all-to-all.
    """
    size, _ = _size_and_rank(group)
    if size == 1:
        return x
    _check_divisible(x, head_dim, size, "gather_seq_scatter_heads (heads)")
    return _AllToAll.apply(x, head_dim % x.dim(), seq_dim % x.dim(), group, size)


def gather_heads_scatter_seq(x: Tensor, head_dim: int, seq_dim: int, group: ProcessGroup | None) -> Tensor:
    """Ulysses all-to-all after attention: full sequence x this rank's heads -> local sequence chunk x all heads.

    The inverse of ``gather_seq_scatter_heads``; backward is that forward all-to-all.
    """
    size, _ = _size_and_rank(group)
    if size == 1:
        return x
    _check_divisible(x, seq_dim, size, "gather_heads_scatter_seq (sequence)")
    return _AllToAll.apply(x, seq_dim % x.dim(), head_dim % x.dim(), group, size)


def _many(
    tensors: Sequence[Tensor], scatter_dim: int, gather_dim: int, group: ProcessGroup | None, what: str
) -> tuple[Tensor, ...] | None:
    """The fused all-to-all of ``tensors`` (all of one number of dims, dtype and device), or None where a tensor
    at a time is the same thing (one tensor, no group) or the tensors cannot share a buffer."""
    size, _ = _size_and_rank(group)
    if size == 1 or len(tensors) < 2:
        return None
    first = tensors[0]
    if any(t.dim() != first.dim() or t.dtype != first.dtype or t.device != first.device for t in tensors):
        return None
    for t in tensors:
        _check_divisible(t, scatter_dim, size, what)
    return _FusedAllToAll.apply(scatter_dim % first.dim(), gather_dim % first.dim(), group, size, *tensors)


def gather_seq_scatter_heads_many(
    tensors: Sequence[Tensor], seq_dim: int, head_dim: int, group: ProcessGroup | None
) -> tuple[Tensor, ...]:
    """``gather_seq_scatter_heads`` of each tensor (q, k, v: their head counts may differ), in one all-to-all."""
    fused = _many(tensors, head_dim, seq_dim, group, "gather_seq_scatter_heads (heads)")
    if fused is not None:
        return fused
    return tuple(gather_seq_scatter_heads(t, seq_dim=seq_dim, head_dim=head_dim, group=group) for t in tensors)


def gather_heads_scatter_seq_many(
    tensors: Sequence[Tensor], head_dim: int, seq_dim: int, group: ProcessGroup | None
) -> tuple[Tensor, ...]:
    """``gather_heads_scatter_seq`` of each tensor, in one all-to-all."""
    fused = _many(tensors, seq_dim, head_dim, group, "gather_heads_scatter_seq (sequence)")
    if fused is not None:
        return fused
    return tuple(gather_heads_scatter_seq(t, head_dim=head_dim, seq_dim=seq_dim, group=group) for t in tensors)


def reduce_token_weighted_loss(loss_sum: Tensor, token_count: Tensor | int, group: ProcessGroup | None) -> Tensor:
    """The mean loss over every token in ``group``: sum of ``loss_sum`` / sum of ``token_count``, on every rank.

    ``loss_sum`` is this rank's summed (not averaged) per-token loss, a scalar; ``token_count`` the number of
    tokens in it, possibly 0. Backward gives ``grad / global_count`` with no communication (the partial-gradient
    convention). If no rank has a token the result is ``loss_sum * 0``: zero, with zero gradient, never NaN.
    """
    if loss_sum.dim() != 0:
        raise ValueError(f"reduce_token_weighted_loss: loss_sum must be a scalar, got shape {tuple(loss_sum.shape)}")
    count = torch.as_tensor(token_count)
    if count.numel() != 1:
        raise ValueError(f"reduce_token_weighted_loss: token_count must be a scalar, got shape {tuple(count.shape)}")
    return _TokenWeightedMean.apply(loss_sum, count.reshape(()), group)

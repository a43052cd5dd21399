"""Halo exchange: a convolution over a grid whose rows are split over a process group (sequence parallelism of a
DiT with a convolutional feed-forward over its (H, W) token grid, e.g. Sana's ``GLUMBConv``: a 3x3 depthwise conv).

Each rank holds a contiguous block of rows (the last rank's block may end in padding rows). A ``k x k`` convolution
of a rank's rows needs ``k // 2`` rows of each neighbour: ``halo_exchange`` returns the local rows with the previous
rank's last ``width`` rows on top and the next rank's first ``width`` rows below (zeros at the ends of the group:
the convolution's own zero padding), as one all-gather of every rank's boundary rows; its backward sends each halo's
gradient back to the rank that owns those rows (one all-gather of the halo gradients) and adds it there, so the
group's gradients are the single-process ones. ``halo_conv2d`` runs a ``nn.Conv2d`` (stride 1, odd kernel, "same"
padding) on the local rows that way: padding rows are zeroed first (below the last real row the full grid has the
conv's zero padding), the rows' own zero padding is dropped, the columns keep theirs. No-op without a group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

__all__ = ["halo_conv2d", "halo_exchange"]


def _gather(x: Tensor, group: dist.ProcessGroup) -> list[Tensor]:
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return parts


class _HaloExchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, dim: int, width: int, group: dist.ProcessGroup) -> Tensor:
        ctx.dim, ctx.width, ctx.group = dim, width, group
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        ends = _gather(torch.cat([x.narrow(dim, 0, width), x.narrow(dim, x.size(dim) - width, width)], dim), group)
        zeros = x.new_zeros(x.narrow(dim, 0, width).shape)
        top = ends[rank - 1].narrow(dim, width, width) if rank > 0 else zeros
        bottom = ends[rank + 1].narrow(dim, 0, width) if rank < size - 1 else zeros
        return torch.cat([top, x, bottom], dim)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None, None]:
        dim, width, group = ctx.dim, ctx.width, ctx.group
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        rows = grad.size(dim) - 2 * width
        halos = _gather(torch.cat([grad.narrow(dim, 0, width), grad.narrow(dim, width + rows, width)], dim), group)
        out = grad.narrow(dim, width, rows).clone()
        if rank < size - 1:  # the next rank's top halo is this rank's last rows
            out.narrow(dim, rows - width, width).add_(halos[rank + 1].narrow(dim, 0, width))
        if rank > 0:  # the previous rank's bottom halo is this rank's first rows
            out.narrow(dim, 0, width).add_(halos[rank - 1].narrow(dim, width, width))
        return out, None, None, None


def halo_exchange(x: Tensor, dim: int, width: int, group: dist.ProcessGroup | None) -> Tensor:
    """``x`` (this rank's rows along ``dim``) with ``width`` neighbour rows above and below (zeros at the group's
    ends); ``x`` itself without a group or with ``width`` 0."""
    if group is None or width == 0:
        return x
    if x.size(dim) < width:
        raise ValueError(f"halo exchange: {x.size(dim)} local rows, fewer than the halo of {width} rows")
    return _HaloExchange.apply(x, dim, width, group)


def halo_conv2d(conv: torch.nn.Conv2d, x: Tensor, valid_rows: int, group: dist.ProcessGroup | None) -> Tensor:
    """``conv(x)`` for ``x`` ``(b, c, local_rows, w)``, this rank's block of the grid's rows, of which the first
    ``valid_rows`` are real (the rest padding); equal to this block of ``conv`` over the whole grid. ``conv`` itself
    without a group."""
    if group is None:
        return conv(x)
    kh, kw = conv.kernel_size
    if conv.stride != (1, 1) or conv.dilation != (1, 1) or kh % 2 == 0 or conv.padding != (kh // 2, kw // 2):
        raise ValueError(
            f"halo_conv2d: a stride-1, undilated conv with an odd kernel and 'same' padding, got kernel "
            f"{conv.kernel_size}, stride {conv.stride}, padding {conv.padding}, dilation {conv.dilation}"
        )
    if valid_rows < x.size(2):
        keep = (torch.arange(x.size(2), device=x.device) < valid_rows).view(1, 1, -1, 1)
        x = x * keep.to(x.dtype)
    x = halo_exchange(x, 2, kh // 2, group)
    return F.conv2d(x, conv.weight, conv.bias, 1, (0, kw // 2), 1, conv.groups)

"""Linear (kernelised, softmax-free) attention under sequence parallelism: a building block for Sana's
``SanaLinearAttnProcessor2_0`` (``out_i = (sum_j v_j k_j^T) q_i / (sum_j k_j)^T q_i`` with ReLU feature maps).

The attention's only token mixing is the sum over keys of ``[v_j; 1] k_j^T``: a ``(b, h, d + 1, d)`` matrix per
head. Each SP rank sums over its own tokens (padding keys zeroed), one all-reduce over the SP group completes the
sum, and every rank applies it to its own queries: exact (the same sum in another order), no all-to-all, no head
divisibility constraint, and the same under Ulysses, ring or both (the all-reduce spans the whole SP group; there is
no softmax log-sum-exp to merge). Backward: the all-reduce's gradient is the all-reduce of the gradients (each
rank's partial sum feeds every rank's queries). No-op without a group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["linear_attention_kv", "sp_all_reduce_sum"]


class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        out = grad.clone()
        dist.all_reduce(out, group=ctx.group)
        return out, None


def sp_all_reduce_sum(x: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """The sum of ``x`` over ``group`` with an exact backward; ``x`` itself without a group."""
    return x if group is None else _AllReduceSum.apply(x, group)


def linear_attention_kv(value: Tensor, key: Tensor, valid: int, group: dist.ProcessGroup | None) -> Tensor:
    """``value @ key`` summed over every token of the SP group: ``value`` ``(b, h, d_v, s)`` (Sana pads a row of
    ones), ``key`` ``(b, h, s, d)`` over this rank's ``s`` tokens, of which the first ``valid`` are real (padding
    keys are zeroed: they are not tokens). Upstream's ``torch.matmul(value, key)`` without a group."""
    if group is None:
        return torch.matmul(value, key)
    if valid < key.size(2):
        keep = (torch.arange(key.size(2), device=key.device) < valid).view(1, 1, -1, 1)
        key = key * keep.to(key.dtype)
    return sp_all_reduce_sum(torch.matmul(value, key), group)

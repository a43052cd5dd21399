"""Chunked linear + cross-entropy: the loss of `hidden @ weight.T` without materialising all logits.

For a sequence of n tokens and a vocabulary of V, the full logits take n*V floats (plus as much again for their
gradient). Here the tokens are processed `chunk_size` at a time in the forward, and the backward recomputes each
chunk's logits, so peak memory is chunk_size*V. Summation order is fixed, so results are deterministic. A final-logit
softcap (gemma2/gemma3's `cap * tanh(logits / cap)`) is applied to each chunk's logits before the cross-entropy, and
its derivative in the backward: without it the chunked loss of a softcapped model would be another model's loss.
"""

from __future__ import annotations

import torch
from torch import Tensor

IGNORE_INDEX = -100


def total_dtype(t: Tensor) -> torch.dtype:
    """Accumulate in at least fp32."""
    return torch.promote_types(t.dtype, torch.float32)


def _chunk_logits(hidden: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    logits = hidden @ weight.t()
    if bias is not None:
        logits = logits + bias
    return logits.to(torch.promote_types(logits.dtype, torch.float32))  # bf16 logits are upcast


def _softcapped(logits: Tensor, softcap: float | None) -> tuple[Tensor, Tensor | None]:
    """(cap * tanh(logits / cap), tanh(logits / cap)) in upstream's op order; (logits, None) without a cap."""
    if softcap is None:
        return logits, None
    tanh = torch.tanh(logits / softcap)
    return tanh * softcap, tanh


class _LinearCrossEntropySum(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        targets: Tensor,
        chunk_size: int,
        ignore_index: int,
        softcap: float | None,
    ) -> Tensor:
        total = hidden.new_zeros((), dtype=torch.promote_types(hidden.dtype, torch.float32))
        for start in range(0, hidden.shape[0], chunk_size):
            h, t = hidden[start : start + chunk_size], targets[start : start + chunk_size]
            logits, _ = _softcapped(_chunk_logits(h, weight, bias), softcap)
            valid = t != ignore_index
            picked = logits.gather(1, t.clamp_min(0)[:, None])[:, 0]
            total = total + torch.where(valid, torch.logsumexp(logits, dim=1) - picked, 0.0).sum()
        ctx.save_for_backward(hidden, weight, bias, targets)
        ctx.chunk_size, ctx.ignore_index, ctx.softcap = chunk_size, ignore_index, softcap
        return total

    @staticmethod
    def backward(ctx, grad_total: Tensor):
        hidden, weight, bias, targets = ctx.saved_tensors
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros_like(weight, dtype=total_dtype(weight))
        grad_bias = None if bias is None else torch.zeros_like(bias, dtype=total_dtype(bias))
        for start in range(0, hidden.shape[0], ctx.chunk_size):
            h, t = hidden[start : start + ctx.chunk_size], targets[start : start + ctx.chunk_size]
            logits, tanh = _softcapped(_chunk_logits(h, weight, bias), ctx.softcap)
            valid = t != ctx.ignore_index
            grad_logits = torch.softmax(logits, dim=1)
            grad_logits[torch.arange(len(t)), t.clamp_min(0)] -= 1.0
            grad_logits = grad_logits * (valid[:, None] * grad_total)
            if tanh is not None:  # d(cap * tanh(z / cap)) / dz = 1 - tanh(z / cap) ** 2
                grad_logits = grad_logits * (1 - tanh * tanh)
            grad_hidden[start : start + ctx.chunk_size] = (grad_logits.to(weight.dtype) @ weight).to(hidden.dtype)
            grad_weight += grad_logits.t() @ h.to(grad_logits.dtype)
            if grad_bias is not None:
                grad_bias += grad_logits.sum(0)
        grad_bias = None if grad_bias is None else grad_bias.to(bias.dtype)
        return grad_hidden, grad_weight.to(weight.dtype), grad_bias, None, None, None, None


def linear_cross_entropy_sum(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    bias: Tensor | None = None,
    chunk_size: int = 1024,
    ignore_index: int = IGNORE_INDEX,
    softcap: float | None = None,
) -> tuple[Tensor, Tensor]:
    """(sum of token losses, number of counted tokens) for logits = hidden @ weight.T + bias, softcapped to
    `softcap * tanh(logits / softcap)` first when `softcap` is given.

    `hidden` is (..., d) and `targets` (...,) with `ignore_index` marking tokens that carry no loss.
    """
    hidden = hidden.reshape(-1, hidden.shape[-1])
    targets = targets.reshape(-1).to(hidden.device)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    loss_sum = _LinearCrossEntropySum.apply(hidden, weight, bias, targets, chunk_size, ignore_index, softcap)
    return loss_sum, (targets != ignore_index).sum()

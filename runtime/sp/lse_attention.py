"""Attention of one query block against one key/value block, with its log-sum-exp, and the merge of such partials.

Ring attention (``runtime.sp.ring``) computes a query chunk's attention block by block; each block gives a partial
output normalised over that block only, plus its LSE. Two partials combine exactly:
``lse = logaddexp(lse_a, lse_b)``, ``out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)``, in fp32.
The backward of a block needs no per-block state: given the *final* output and LSE, the block's softmax
probabilities are ``exp(s - lse)``, so the fused SDPA backward kernels give that block's exact gradient contribution.

Kernels (all return the LSE; the mask is additive float, ``-inf`` where a key is hidden):
* CPU: ``aten._scaled_dot_product_flash_attention_for_cpu`` and its ``_backward`` (tested).
* CUDA: ``aten._scaled_dot_product_efficient_attention`` (takes an additive bias, returns the LSE) and its
  ``_backward``. UNTESTED here (no GPU in CI); flash/cuDNN would need their own varlen mask handling.
A row whose keys are all hidden in a block gets ``out = 0`` and ``lse = -inf`` (the CPU kernel reports 0 for it,
which would be wrong in a merge), so such a block contributes nothing.
"""

from __future__ import annotations

import torch
from torch import Tensor

from runtime import torch_compat

__all__ = ["additive_mask", "attention_with_lse", "attention_with_lse_backward", "merge_partials"]


def additive_mask(allowed: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """A boolean "may attend" mask as the kernels' additive float bias (0 or -inf)."""
    if allowed is None:
        return None
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))


def _lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def attention_with_lse(
    q: Tensor, k: Tensor, v: Tensor, *, scale: float, allowed: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """``(out, lse)`` of ``softmax(q k^T * scale) v`` over the keys ``allowed`` lets each query see.

    q, k, v: (b, h, s, d) with equal head counts (repeat KV heads first). ``allowed``: bool, broadcastable to
    (b, h, sq, sk), or None for "every key". ``lse`` is (b, h, sq) in fp32 (fp64 for fp64 inputs).
    """
    bias = additive_mask(allowed, q.dtype)
    if q.device.type == "cuda":  # UNTESTED: no GPU where this project is tested
        out, lse = torch_compat.cuda_attention_with_lse(q, k, v, bias, scale)
    else:
        out, lse = torch_compat.cpu_attention_with_lse(q, k, v, bias, scale)
    lse = lse.to(_lse_dtype(q.dtype))
    if allowed is not None:
        seen = allowed.any(-1).expand(lse.shape)
        lse = lse.masked_fill(~seen, float("-inf"))
        out = out.masked_fill(~seen[..., None], 0.0)
    return out, lse


def attention_with_lse_backward(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    *,
    scale: float,
    allowed: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of one block given the *final* ``out`` and ``lse`` of the whole attention (see module doc)."""
    bias = additive_mask(allowed, q.dtype)
    if q.device.type == "cuda":  # UNTESTED: no GPU where this project is tested
        return torch_compat.cuda_attention_with_lse_backward(grad_out, q, k, v, bias, out, lse, scale)
    lse = lse.to(q.dtype) if q.dtype == torch.float64 else lse.float()
    return torch_compat.cpu_attention_with_lse_backward(grad_out, q, k, v, bias, out, lse, scale)


def merge_partials(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    """Combine two partial attentions over disjoint key sets: ``(out, lse)`` in the LSE's dtype (fp32 or fp64).

    ``out_*``: (b, h, s, d); ``lse_*``: (b, h, s), ``-inf`` for a row that saw no key (it then contributes 0).
    """
    lse = torch.logaddexp(lse_a, lse_b)
    finite = torch.isfinite(lse)
    safe = torch.where(finite, lse, torch.zeros_like(lse))
    w_a = torch.where(finite, torch.exp(lse_a - safe), torch.zeros_like(lse))[..., None]
    w_b = torch.where(finite, torch.exp(lse_b - safe), torch.zeros_like(lse))[..., None]
    return out_a.to(lse.dtype) * w_a + out_b.to(lse.dtype) * w_b, lse

"""DiT attention under a ring (``parallel.ring`` > 1): the model's attention call becomes ``ring_attention``.

The ``dit/ring_attention`` template wraps each split-carrying attention call of a DiT as
``ring_dispatch(<split>, <callee>)(<upstream's arguments>)``. Without a ring (SP off, Ulysses only, or a call that
receives no split) ``ring_dispatch`` returns the callee itself, so the generated model runs upstream's call.

Under a ring, ``runtime.diffusion.sp.ulysses_to_heads`` has left this rank its ring rank's contiguous span of
``ulysses x local`` image tokens (padding included) for its share of the heads, in queries, keys and values alike,
plus (joint attention) the replicated text segment for the same heads. The call then runs ``runtime.sp.ring``'s
``ring_attention`` (the project's one ring: K/V blocks passed to the next ring rank while the current block is
attended, partials merged by log-sum-exp, a backward that keeps only the local q/k/v/out/lse and re-circulates K/V):

* queries: this ring rank's share of the text queries (the text is replicated: each ring rank takes a contiguous
  ``1/ring`` of its queries, zero-padded), followed by the span's queries. The text output is all-gathered over the
  ring group afterwards, so every ring rank holds the same bits (a replicated stream must be bitwise replicated:
  ``sp_layout.check_layout`` checks it, and every rank's later blocks compute the same text from it); backward
  reduce-scatters the ranks' partial gradients of each share;
* ring keys/values: the span's. Padding keys (past the real token count, in the last ring ranks' spans) and keys
  the model's key mask hides (its sharded columns, every ring rank's span: Lumina2's per-sample padding of a joint
  ``[text, image, pad]`` sequence) are hidden by ``kv_valid``; padding queries see real keys, and their output is
  dropped by ``ulysses_to_sequence``;
* ``extra_kv``: the text keys/values, seen exactly once by every query, never sent around the ring; the key mask's
  text columns (Qwen-Image, HunyuanVideo: boolean, ``(b, 1, 1, s)``) hide padded text keys.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from runtime.config.errors import LayoutRefused
from runtime.diffusion.sp import AttentionSplit
from runtime.parallel.collectives import gather_along_dim, pad_and_slice, unpad
from runtime.sp.ring import ring_attention

__all__ = ["ring_dispatch"]

CALLEE_DIMS = {"dispatch_attention_fn": "bshd", "scaled_dot_product_attention": "bhsd"}  # what each takes


def ring_dispatch(split: AttentionSplit | None, attention: Callable[..., Tensor]) -> Callable[..., Tensor]:
    """``attention`` itself unless this call carries the split under a ring; then a function with the same
    positional/keyword parameters (``query, key, value, attn_mask=..., dropout_p=..., is_causal=..., scale=...``,
    backend arguments ignored) that runs ring attention in the split's stated layout."""
    if split is None or split.shard.ring_size == 1:
        return attention
    # the callee's own layout where it is a known one: a call that transposes q/k/v inline passes them in another
    # order than the one stated for the tensors before it (Cosmos: dispatch_attention_fn(query.transpose(1, 2)))
    dims = CALLEE_DIMS.get(getattr(attention, "__name__", ""))
    return functools.partial(_ring_call, dataclasses.replace(split, layout=split.layout.with_dims(dims)))


def _refuse(site: str, dropout_p: float, is_causal: bool, parallel_config: Any) -> None:
    if dropout_p:
        raise ValueError(f"{site}: ring attention does not support attention dropout (got {dropout_p}); set it to 0")
    if is_causal:
        raise ValueError(f"{site}: the DiT ring attends without a causal mask; this call asks for one")
    if parallel_config is not None:
        raise ValueError(
            f"{site}: diffusers' own context parallelism (parallel_config) is set; use parallel.ring instead"
        )


def _valid(site: str, mask: Tensor | None, start: int, count: int) -> Tensor | None:
    """(b or 1, count) bool: which of the mask's keys ``[start, start + count)`` may be seen; None when all may."""
    if mask is None or not count:
        return None
    if mask.dtype != torch.bool:
        raise LayoutRefused(
            f"{site}: under a ring the attention mask must be boolean, got {mask.dtype}; train with parallel.ring: 1"
        )
    return mask.narrow(-1, start, count).reshape(mask.size(0), count)


def _kv_valid(split: AttentionSplit, mask: Tensor | None, start: int, device: torch.device) -> Tensor | None:
    """(ring, b or 1, span) bool for ``ring_attention``: every ring rank's span keys that are real tokens (not SP
    padding) and that the key mask's sharded columns (``[start, start + ring * span)``) do not hide."""
    shard = split.shard
    ring, span = shard.ring_size, shard.span
    valid = None
    if shard.pad:
        valid = (torch.arange(ring * span, device=device) < shard.tokens).view(ring, 1, span)
    masked = _valid(split.layout.site, mask, start, ring * span)
    if masked is not None:
        masked = masked.view(masked.size(0), ring, span).transpose(0, 1)
        valid = masked if valid is None else valid & masked
    return valid


def _ring_call(
    split: AttentionSplit,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    parallel_config: Any = None,
    **backend: Any,
) -> Tensor:
    shard, layout = split.shard, split.layout
    _refuse(layout.site, dropout_p, is_causal, parallel_config)
    # (b, s, h, d) -> (b, h, s, d): ring_attention's layout
    query, key, value = (layout.to_bshd(x).transpose(1, 2) for x in (query, key, value))
    span, count = shard.span, query.size(2) - shard.span
    text_start, span_start = (0, count) if layout.replicated == "first" else (span, 0)
    q_text, q_span = query.narrow(2, text_start, count), query.narrow(2, span_start, span)
    k_text, k_span = key.narrow(2, text_start, count), key.narrow(2, span_start, span)
    v_text, v_span = value.narrow(2, text_start, count), value.narrow(2, span_start, span)
    # the mask's columns: [text, every ring rank's span] or [every span, text] (ulysses_to_heads)
    mask_text, mask_spans = (0, count) if layout.replicated == "first" else (shard.ring_size * span, 0)
    kv_valid = _kv_valid(split, attn_mask, mask_spans, query.device)
    if count:  # this ring rank's share of the text queries (zero-padded: a padding query's output is dropped)
        q_text, text_pad = pad_and_slice(q_text, 2, shard.ring_group)
    out = ring_attention(
        torch.cat([q_text, q_span], 2) if count else q_span,
        k_span,
        v_span,
        group=shard.ring_group,
        causal=False,
        scale=scale if scale is not None else 1.0 / math.sqrt(query.size(-1)),
        extra_kv=(k_text, v_text) if count else None,
        kv_valid=kv_valid,
        extra_valid=_valid(layout.site, attn_mask, mask_text, count),
    )
    local = out.narrow(2, out.size(2) - span, span)
    if not count:
        return layout.from_bshd(local.transpose(1, 2))
    # every ring rank's text rows: the text output is then bitwise the same on every ring rank (backward: the
    # reduce-scatter sums the ranks' partial gradients of each share)
    text = unpad(gather_along_dim(out.narrow(2, 0, out.size(2) - span), 2, shard.ring_group), 2, text_pad)
    joined = torch.cat([text, local] if layout.replicated == "first" else [local, text], 2)
    return layout.from_bshd(joined.transpose(1, 2))

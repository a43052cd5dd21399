"""Ring attention: a rank's query chunk attends to every ring rank's key/value chunk, one chunk per step.

Choice: K/V are **passed around the ring** (point-to-point ``batch_isend_irecv`` to the next rank, from the
previous one), not all-gathered. A rank then holds two K/V chunks at a time (its current one and the one in
flight) instead of all ``ring`` of them, so activation memory per rank stays ``O(L / ring)``, and each step's
transfer is posted before that step's block attention, so communication overlaps compute. The all-gather
alternative is simpler but holds the full K/V (``O(L)``) per layer during forward and backward, defeating the
point of going past the head count for long sequences.

Exactness: each block gives ``(out, lse)`` (``runtime.sp.lse_attention``), merged in fp32 with log-sum-exp, so the
result equals full-sequence attention up to rounding. Causality and packed-sequence (document) boundaries are
decided per (query, key) pair from each token's *global index* and *document id*, so they hold across chunk
edges and for any assignment of tokens to ranks (contiguous or zigzag); only the per-block ``sq x sk`` boolean is
built, never an ``L x L`` mask. A block whose pairs are all hidden (e.g. a causal chunk entirely in the future) is
skipped: it costs neither compute nor a kernel call.

Load balance: with contiguous chunks and causal masking, ring rank ``r`` computes ``r + 1`` of the ``ring`` blocks.
``zigzag_indices`` (``runtime.sp.layout``, the layout the data layer uses under a ring) gives rank ``r`` chunks ``r``
and ``2 * ring - 1 - r`` of ``2 * ring``, which evens the work; ring attention is exact for any layout (the caller
passes each token's global index).

Backward does not store all K/V: the autograd function saves only local q, k, v, the final out and lse, and in
backward re-circulates K/V around the ring together with the dK/dV accumulators, which finally reach their owner.
``extra_kv`` is a key/value segment every query must see exactly once (e.g. a DiT's replicated text tokens in
joint attention): it is attended locally, never passed around, and its gradient is this rank's queries' part.

Attention sinks (``sink``: one learned logit per query head in the softmax denominator, gpt_oss's ``s_aux``): with
the merged output ``O`` and log-sum-exp ``L`` of a query, the sink-corrected output is ``O * exp(L - L')`` with
``L' = logaddexp(L, sink)`` (``O * sigmoid(L - sink)``). ``O'`` and ``L'`` are exactly the attention over the keys
plus a key of logit ``sink`` and value 0, so each block's backward from ``(O', L')`` is exact as before, and the
sink's gradient is ``-sum_i exp(sink - L'_i) * (dO'_i . O'_i)`` over this rank's queries.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from runtime.sp.heads import repeat_kv_heads
from runtime.sp.layout import zigzag_indices
from runtime.sp.lse_attention import attention_with_lse, attention_with_lse_backward, merge_partials

__all__ = ["ring_attention", "zigzag_indices", "contiguous_indices"]


def contiguous_indices(length: int, ring: int, rank: int) -> Tensor:
    """Global token indices of ring rank ``rank``'s chunk when the sequence is cut into ``ring`` contiguous chunks."""
    chunk = length // ring
    return torch.arange(rank * chunk, (rank + 1) * chunk)


def _allowed(
    q_index: Tensor,
    k_index: Tensor,
    q_doc: Tensor | None,
    k_doc: Tensor | None,
    causal: bool,
    window: int | None,
    k_valid: Tensor | None = None,
) -> Tensor | None:
    """(b or 1, 1, sq, sk) bool "may attend", or None when every pair may. ``window``: a key is visible only when
    fewer than ``window`` tokens before the query (transformers' sliding-window rule). ``k_valid``: (b or 1, sk),
    False for a key no query may see (padding)."""
    allowed = None if k_valid is None else k_valid[:, None, None, :]
    if causal:
        causal_ok = (k_index[None, :] <= q_index[:, None])[None, None]
        allowed = causal_ok if allowed is None else allowed & causal_ok
    if window is not None:
        near = (k_index[None, :] > q_index[:, None] - window)[None, None]
        allowed = near if allowed is None else allowed & near
    if q_doc is not None:
        same = (q_doc[:, :, None] == k_doc[:, None, :])[:, None]
        allowed = same if allowed is None else allowed & same
    return allowed


def _exchange(tensors: list[Tensor], group: ProcessGroup) -> tuple[list[Tensor], list[Any]]:
    """Send ``tensors`` to the next ring rank, receive the previous rank's into fresh buffers (asynchronously)."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    to, frm = dist.get_global_rank(group, (rank + 1) % size), dist.get_global_rank(group, (rank - 1) % size)
    received = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in tensors]
    ops = [dist.P2POp(dist.isend, t.contiguous(), to, group) for t in tensors]
    ops += [dist.P2POp(dist.irecv, r, frm, group) for r in received]
    return received, dist.batch_isend_irecv(ops)


def _wait(requests: list[Any]) -> None:
    for request in requests:
        request.wait()


def _fold(grad: Tensor, repeat: int) -> Tensor:
    """The gradient of repeated KV heads summed back onto the original heads."""
    if repeat == 1:
        return grad
    b, h, s, d = grad.shape
    return grad.view(b, h // repeat, repeat, s, d).sum(2)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        extra_k: Tensor | None,
        extra_v: Tensor | None,
        index: Tensor,
        docs: Tensor | None,
        kv_valid: Tensor | None,
        extra_valid: Tensor | None,
        group: ProcessGroup,
        causal: bool,
        scale: float,
        window: int | None,
        sink: Tensor | None,
    ) -> Tensor:
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        repeat = q.shape[1] // k.shape[1]
        q_doc = None if docs is None else docs[rank]
        extra_allowed = None if extra_valid is None else extra_valid[:, None, None, :]
        out = lse = None
        if extra_k is not None:
            out, lse = attention_with_lse(
                q,
                repeat_kv_heads(extra_k, repeat),
                repeat_kv_heads(extra_v, repeat),
                scale=scale,
                allowed=extra_allowed,
            )
        held = [k, v]
        for step in range(size):
            pending = _exchange(held, group) if step < size - 1 else None
            owner = (rank - step) % size
            k_doc = None if docs is None else docs[owner]
            k_valid = None if kv_valid is None else kv_valid[owner]
            allowed = _allowed(index[rank], index[owner], q_doc, k_doc, causal, window, k_valid)
            if allowed is None or bool(allowed.any()):
                o, s = attention_with_lse(
                    q, repeat_kv_heads(held[0], repeat), repeat_kv_heads(held[1], repeat), scale=scale, allowed=allowed
                )
                out, lse = (o.to(s.dtype), s) if out is None else merge_partials(out, lse, o, s)
            if pending is not None:
                _wait(pending[1])
                held = pending[0]
        if sink is not None:  # a key of logit `sink` and value 0 in every query's softmax
            total = torch.logaddexp(lse, sink.detach().to(lse.dtype)[None, :, None].expand_as(lse))
            out, lse = out * torch.exp(lse - total)[..., None], total
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, extra_k, extra_v, out, lse, index, docs, kv_valid, extra_allowed, sink)
        ctx.group, ctx.causal, ctx.scale, ctx.repeat, ctx.window = group, causal, scale, repeat, window
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, extra_k, extra_v, out, lse, index, docs, kv_valid, extra_allowed, sink = ctx.saved_tensors
        group, repeat, scale = ctx.group, ctx.repeat, ctx.scale
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        grad_out = grad_out.contiguous()
        q_doc = None if docs is None else docs[rank]
        acc = torch.promote_types(q.dtype, torch.float32)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        d_extra_k = d_extra_v = None
        if extra_k is not None:
            gq, gk, gv = attention_with_lse_backward(
                grad_out,
                q,
                repeat_kv_heads(extra_k, repeat),
                repeat_kv_heads(extra_v, repeat),
                out,
                lse,
                scale=scale,
                allowed=extra_allowed,
            )
            dq += gq
            d_extra_k, d_extra_v = _fold(gk, repeat).to(extra_k.dtype), _fold(gv, repeat).to(extra_v.dtype)
        held = [k, v]
        dkv = [torch.zeros(k.shape, dtype=acc, device=k.device), torch.zeros(v.shape, dtype=acc, device=v.device)]
        dkv_pending: tuple[list[Tensor], list[Any]] = ([], [])
        for step in range(size):
            pending = _exchange(held, group) if step < size - 1 else None
            owner = (rank - step) % size
            k_doc = None if docs is None else docs[owner]
            k_valid = None if kv_valid is None else kv_valid[owner]
            allowed = _allowed(index[rank], index[owner], q_doc, k_doc, ctx.causal, ctx.window, k_valid)
            if step > 0:  # the dK/dV of the block now held arrive from the previous rank
                _wait(dkv_pending[1])
                dkv = dkv_pending[0]
            if allowed is None or bool(allowed.any()):
                gq, gk, gv = attention_with_lse_backward(
                    grad_out,
                    q,
                    repeat_kv_heads(held[0], repeat),
                    repeat_kv_heads(held[1], repeat),
                    out,
                    lse,
                    scale=scale,
                    allowed=allowed,
                )
                dq += gq
                dkv = [dkv[0] + _fold(gk, repeat), dkv[1] + _fold(gv, repeat)]
            dkv_pending = _exchange(dkv, group)  # after the last step this returns each block to its owner
            if pending is not None:
                _wait(pending[1])
                held = pending[0]
        _wait(dkv_pending[1])
        dk, dv = dkv_pending[0]
        grads = (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), d_extra_k, d_extra_v)
        d_sink = None
        if sink is not None:
            row = (grad_out.to(lse.dtype) * out.to(lse.dtype)).sum(-1)  # (b, h, s): dO' . O'
            d_sink = -(torch.exp(sink.to(lse.dtype)[None, :, None] - lse) * row).sum((0, 2)).to(sink.dtype)
        return (*grads, None, None, None, None, None, None, None, None, d_sink)


def _local_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    index: Tensor,
    docs: Tensor | None,
    causal: bool,
    scale: float,
    extra_kv: tuple[Tensor, Tensor] | None,
    window: int | None,
    k_valid: Tensor | None,
    extra_valid: Tensor | None,
    sink: Tensor | None = None,
) -> Tensor:
    """``ring_attention`` without a ring: SDPA over the local tokens (and ``extra_kv`` first), same masking."""
    allowed = _allowed(index, index, docs, docs, causal, window, k_valid)
    repeat = q.shape[1] // k.shape[1]
    keys, values = repeat_kv_heads(k, repeat), repeat_kv_heads(v, repeat)
    if extra_kv is not None:
        keys = torch.cat([repeat_kv_heads(extra_kv[0], repeat), keys], 2)
        values = torch.cat([repeat_kv_heads(extra_kv[1], repeat), values], 2)
        if allowed is not None or extra_valid is not None:
            local = allowed if allowed is not None else torch.ones(1, 1, 1, k.shape[2], dtype=torch.bool)
            seen = torch.ones(1, 1, 1, extra_kv[0].shape[2], dtype=torch.bool)
            if extra_valid is not None:
                seen = extra_valid[:, None, None, :]
            batch, rows = max(local.shape[0], seen.shape[0]), max(local.shape[2], seen.shape[2])
            parts = [x.to(q.device).expand(batch, 1, rows, x.shape[-1]) for x in (seen, local)]
            allowed = torch.cat(parts, -1)
    if sink is None:
        return torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=allowed, scale=scale)
    logits = torch.matmul(q, keys.transpose(-1, -2)) * scale
    if allowed is not None:
        logits = logits.masked_fill(~allowed, float("-inf"))
    column = sink.to(logits.dtype)[None, :, None, None].expand(*logits.shape[:-1], 1)
    probs = torch.softmax(torch.cat([logits, column], -1), -1)[..., :-1]
    return torch.matmul(probs, values)


def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    group: ProcessGroup | None,
    causal: bool,
    scale: float,
    index: Tensor | None = None,
    doc_ids: Tensor | None = None,
    extra_kv: tuple[Tensor, Tensor] | None = None,
    window: int | None = None,
    kv_valid: Tensor | None = None,
    extra_valid: Tensor | None = None,
    sink: Tensor | None = None,
) -> Tensor:
    """Attention of this rank's queries over the keys of every rank of the ring ``group``: (b, hq, s, d).

    q: (b, hq, s, d); k, v: (b, hkv, s, d) with ``hq`` a multiple of ``hkv`` (GQA). Every rank holds ``s`` tokens.
    ``index``: (ring, s) global token index of every rank's tokens (same for every rank; default: contiguous
    chunks), used for causality. ``doc_ids``: (ring, b, s) document id of every rank's tokens (packed sequences: a
    query sees only keys of its own document), or None. ``extra_kv``: a (b, hkv, se, d) pair every query sees once,
    unmasked unless ``extra_valid`` ((b or 1, se) bool) hides some of its keys. ``kv_valid``: (ring, b or 1, s) bool,
    False for a rank's key no query may see (e.g. padding), or None. ``window``: sliding-window size (transformers'
    rule), or None. ``sink``: (hq,) attention-sink logits (see module doc), or None. Value heads may have another
    size than query/key heads: the narrower side is padded with zero columns (exact) for the fused kernels. With
    ``group=None`` (no ring) this is plain attention over the local tokens.
    """
    if v.shape[-1] != q.shape[-1]:  # value heads of another size (MiMo-V2-Flash): zero columns, exact either way
        width = max(q.shape[-1], v.shape[-1])
        pad = lambda t: torch.nn.functional.pad(t, (0, width - t.shape[-1]))  # noqa: E731
        if extra_kv is not None:
            extra_kv = (pad(extra_kv[0]), pad(extra_kv[1]))
        out = ring_attention(
            pad(q),
            pad(k),
            pad(v),
            group=group,
            causal=causal,
            scale=scale,
            index=index,
            doc_ids=doc_ids,
            extra_kv=extra_kv,
            window=window,
            kv_valid=kv_valid,
            extra_valid=extra_valid,
            sink=sink,
        )
        return out[..., : v.shape[-1]]
    size = 1 if group is None else dist.get_world_size(group)
    if index is None:
        index = torch.stack([contiguous_indices(size * q.shape[2], size, r) for r in range(size)])
    index = index.to(q.device)
    if group is None:
        docs = None if doc_ids is None else doc_ids[0]
        valid = None if kv_valid is None else kv_valid[0]
        return _local_attention(q, k, v, index[0], docs, causal, scale, extra_kv, window, valid, extra_valid, sink)
    extra_k, extra_v = extra_kv if extra_kv is not None else (None, None)
    return _RingAttention.apply(
        q, k, v, extra_k, extra_v, index, doc_ids, kv_valid, extra_valid, group, causal, scale, window, sink
    )

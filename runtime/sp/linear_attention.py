"""Sequence parallelism and packed documents for linear-attention mixers (gated delta-net layers: Qwen3-Next).

A gated delta-net layer mixes the sequence in two places only: a short causal depthwise convolution over its
projected q/k/v channels, and the gated delta rule, a recurrence over the sequence per value head. Everything
between them (projections, gates, norms) is per token. Under SP each rank holds a slice of the tokens, so both
mixing steps run here over the *whole* sequence (Ulysses):

* ``sequence_conv1d``: all-to-all from (all channels, local tokens) to (this rank's channels, every token), the
  convolution with this rank's slice of the depthwise weight, all-to-all back. Depthwise: each channel needs only
  its own past, so any channel split is exact.
* ``linear_attention_heads``: all-to-all of q, k, v, g and beta from (local tokens, all heads) to (every token, this
  rank's heads), the recurrence on those heads, all-to-all of its output back before the gated norm and the
  out-projection (per token again).

Every rank of the SP group takes part, with or without a ring (``parallel.ring`` splits only the softmax attention
layers' keys): the gathered tokens are put in the row's natural order first (``runtime.sp.layout``), so the layer
is exact under Ulysses, a ring or both, provided the SP size divides the value heads and the conv channels.

Packed documents: upstream's flash-linear-attention kernel takes the packed row's document boundaries
(``cu_seq_lens_q``, as flash attention's varlen path); its torch path has none and carries the state across
documents. Given boundaries (``documents``: the cumulative lengths over the whole row, what
``runtime.data.sp_batch.packed_attention_kwargs`` computes), the convolution and the recurrence restart at each
document here, in one process as under SP. Without them, and with SP off, both calls are upstream's own (bitwise).
causal-conv1d's fused convolution reads ``seq_idx`` instead, which the trainer does not pass: with it installed and
SP off a packed row's convolution carries ``kernel - 1`` tokens across each boundary (under SP it is refused).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from runtime.config.errors import LayoutRefused
from runtime.parallel.collectives import gather_heads_scatter_seq, gather_seq_scatter_heads
from runtime.parallel.sites import mark_site
from runtime.parallel.state import get_parallel_state
from runtime.sp.layout import gathered_order, to_natural_order

__all__ = ["linear_attention_heads", "sequence_conv1d"]


def _spans(documents: Tensor | None, length: int) -> list[tuple[int, int]]:
    """(start, end) of each document of a row of ``length`` tokens; one span without boundaries."""
    if documents is None:
        return [(0, length)]
    cu = [int(x) for x in documents.flatten().tolist()]
    if cu[0] != 0 or cu[-1] != length or any(b < a for a, b in zip(cu, cu[1:], strict=False)):
        raise ValueError(
            f"packed document boundaries (cu_seq_lens_q) {cu} do not cover the row of {length} tokens: they must run "
            f"from 0 to the row's (SP-padded) length, ascending; runtime.data.sp_batch.packed_attention_kwargs "
            f"computes them from the row's global position ids"
        )
    return [(a, b) for a, b in zip(cu, cu[1:], strict=False) if b > a]


def _to_rank_order(natural: Tensor, dim: int, sp_size: int, ring_size: int) -> Tensor:
    """The inverse of ``to_natural_order``: a full row back in the order the SP ranks hold it (identity without a
    ring)."""
    if ring_size == 1:
        return natural
    order = gathered_order(natural.shape[dim], sp_size, ring_size).to(natural.device)
    return natural.index_select(dim, order)


def _check_split(what: str, size: int, sp: int, module: Any) -> None:
    if size % sp:
        raise LayoutRefused(
            f"parallel.sp: {sp} does not divide the {size} {what} of {type(module).__name__} (linear attention runs "
            f"Ulysses over the whole SP group, ring included): choose an SP size dividing {size}"
        )


def sequence_conv1d(conv: torch.nn.Conv1d, documents: Tensor | None, x: Tensor) -> Tensor:
    """``conv(x)`` for upstream's short causal depthwise convolution (``padding = kernel - 1``, the caller keeps the
    first ``x.shape[-1]`` outputs) on ``x`` ``(b, channels, local tokens)``: under SP over the whole sequence on this
    rank's channels, restarting at each document of ``documents`` (module docstring). ``conv(x)`` itself without SP
    and without documents."""
    state = get_parallel_state()
    if not state.sp_enabled and documents is None:
        return conv(x)
    weight, bias = conv.weight, conv.bias
    if state.sp_enabled:
        sp, group = state.sp_size, state.sp_group
        _check_split("convolution channels", x.shape[1], sp, conv)
        x = to_natural_order(gather_seq_scatter_heads(x, seq_dim=2, head_dim=1, group=group), 2, sp, state.ring_size)
        width = weight.shape[0] // sp
        weight = weight[state.sp_rank * width : (state.sp_rank + 1) * width]
        bias = None if bias is None else bias[state.sp_rank * width : (state.sp_rank + 1) * width]
    pad, channels = conv.kernel_size[0] - 1, x.shape[1]
    parts = [
        F.conv1d(x[..., a:b], weight, bias, padding=pad, groups=channels)[..., : b - a]
        for a, b in _spans(documents, x.shape[-1])
    ]
    out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
    if state.sp_enabled:
        out = _to_rank_order(out, 2, state.sp_size, state.ring_size)
        out = gather_heads_scatter_seq(out, head_dim=1, seq_dim=2, group=state.sp_group)
    return out


def _native_documents(kernel: Callable[..., Any]) -> bool:
    """Whether ``kernel`` takes packed boundaries itself (flash-linear-attention's ``cu_seqlens``); upstream's torch
    fallback accepts the keyword and ignores it."""
    return getattr(kernel, "__module__", "").startswith("fla.")


def _by_document(kernel: Callable[..., Any], documents: Tensor | None) -> Callable[..., Any]:
    """``kernel`` run on each document alone (fresh state per document), outputs concatenated along the sequence;
    the final states, when asked for, stacked one per document (as flash-linear-attention returns them)."""

    def run(query: Tensor, key: Tensor, value: Tensor, g: Tensor, beta: Tensor, **kwargs: Any) -> tuple:
        if documents is None or _native_documents(kernel):
            return kernel(query, key, value, g=g, beta=beta, **kwargs, cu_seqlens=documents)
        if kwargs.get("initial_state") is not None:
            raise ValueError("packed documents (cu_seq_lens_q) with a cached recurrent state: not supported")
        outs, states = [], []
        for a, b in _spans(documents, query.shape[1]):
            out, state = kernel(query[:, a:b], key[:, a:b], value[:, a:b], g=g[:, a:b], beta=beta[:, a:b], **kwargs)
            outs.append(out)
            states.append(state)
        final = torch.cat(states) if kwargs.get("output_final_state") else None
        return torch.cat(outs, dim=1), final

    return run


def linear_attention_heads(kernel: Callable[..., Any], module: torch.nn.Module) -> Callable[..., Any]:
    """The chunked gated-delta-rule call of ``module`` (q, k, v ``(b, s, heads, d)``, g and beta ``(b, s, heads)``):
    under SP over every token on this rank's heads (module docstring), marking ``module`` as a checked site;
    restarting at each packed document when the call passes ``cu_seqlens``; upstream's ``kernel`` itself otherwise."""
    state = get_parallel_state()
    if not state.sp_enabled:

        def local(*args: Any, cu_seqlens: Tensor | None = None, **kwargs: Any) -> tuple:
            if cu_seqlens is None:  # upstream's call, unchanged
                return kernel(*args, **kwargs, cu_seqlens=cu_seqlens)
            return _by_document(kernel, cu_seqlens)(*args, **kwargs)

        return local
    if getattr(module, "causal_conv1d_fn", None) is not None:
        raise LayoutRefused(
            f"parallel.sp: {state.sp_size} with causal-conv1d's fused kernel installed: {type(module).__name__}'s "
            f"convolution would see this rank's tokens only; uninstall causal-conv1d for SP runs (the torch "
            f"convolution is split over SP) or train with parallel.sp: 1"
        )

    def run(
        query: Tensor, key: Tensor, value: Tensor, g: Tensor, beta: Tensor, cu_seqlens: Tensor | None = None, **kw
    ) -> tuple[Tensor, Tensor | None]:
        mark_site(module)
        if kw.get("initial_state") is not None or kw.get("output_final_state"):
            raise ValueError("sequence parallel training does not support a recurrent-state cache (past_key_values)")
        sp, group, ring = state.sp_size, state.sp_group, state.ring_size
        _check_split("value heads", value.shape[2], sp, module)
        # (b, s/sp, h, d) -> (b, s, h/sp, d), the row in its natural order (a ring holds zigzag chunks)
        q, k, v, gate, b = (
            to_natural_order(gather_seq_scatter_heads(t, seq_dim=1, head_dim=2, group=group), 1, sp, ring)
            for t in (query, key, value, g, beta)
        )
        out, _ = _by_document(kernel, cu_seqlens)(q, k, v, gate, b, **kw)
        out = _to_rank_order(out, 1, sp, ring)
        return gather_heads_scatter_seq(out, head_dim=2, seq_dim=1, group=group), None

    return run

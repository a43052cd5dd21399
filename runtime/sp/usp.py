"""Ulysses x ring (USP) attention for the generated language models.

Registered as ``usp_<inner>`` in transformers' AttentionInterface; ``ulysses_attn_implementation`` returns it when
the layout has a ring (``parallel.ring > 1``). Per call:

1. Ulysses (when ``ulysses_size > 1``): all-to-all over the Ulysses group, (b, h, s/sp, d) -> (b, h/u, s/ring, d):
   the ring rank's contiguous chunk of the sequence, for this rank's share of the heads.
2. Ring attention (``runtime.sp.ring``) over the ring group, causal, with the packed documents found from the
   *global* position ids the model passes to every attention call (a new document starts where the position does not
   follow the previous one, as transformers decides packing), so no ``L x L`` mask is needed: under a ring the
   mask builders return a ``RingMask`` (``runtime.sp.positions.full_sequence_mask``) that only says whether the
   layer has a sliding window (some models pass the window only through the mask, qwen2_moe for one) or attends in
   chunks (Llama 4's chunked layers: each document is cut at chunk boundaries, ``segment_ids``).
3. The inverse all-to-all back to (b, s/sp, h, d).

Tokens are laid out zigzag over the ring (``runtime.sp.layout``: the data layer, the RoPE slice, the label shift and
the VLM's visual-token scatter all follow it), so after the all-to-all ring rank ``i`` holds chunks ``i`` and
``2 * ring - 1 - i`` of ``2 * ring`` and every ring rank does the same causal work (fully hidden blocks are skipped).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from runtime.config.errors import LayoutRefused
from runtime.parallel.collectives import gather_heads_scatter_seq
from runtime.parallel.sites import mark_site
from runtime.parallel.state import get_parallel_state
from runtime.sp.head_kwargs import heads_of_rank
from runtime.sp.heads import kv_repeat_factor, repeat_kv_heads
from runtime.sp.layout import zigzag_indices
from runtime.sp.overlap import seq_to_heads
from runtime.sp.positions import RingMask
from runtime.sp.ring import ring_attention

PREFIX = "usp_"


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """(b, L) document index of every token of packed rows: a document starts where the position does not follow."""
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    return starts.long().cumsum(1)


def segment_ids(position_ids: torch.Tensor, mask: RingMask) -> torch.Tensor | None:
    """(b, L) id of the span a token may attend within (None: the whole row): its packed document when the mask
    builder saw the position ids, and under chunked attention its chunk of the row (a (document, chunk) pair)."""
    docs = document_ids(position_ids) if mask.documents else None
    if mask.chunk is None:
        return docs
    length = position_ids.shape[-1]
    chunks = (torch.arange(length, device=position_ids.device) // mask.chunk).expand_as(position_ids)
    return chunks if docs is None else docs * (length // mask.chunk + 1) + chunks


# What the ring implementation honours of the keyword arguments attention modules pass: the scale, the window
# (through the ``RingMask``, which every sliding-window layer's mask builder returns), the global position ids it
# finds the documents from; the packing metadata of flash-attention's varlen path and the SP padding mask are
# derived from those position ids instead. A model's forward also hands its own flags down to every attention call
# (``output_router_logits``, ...): booleans, integers and strings change no softmax. Attention sinks (``s_aux``, one
# learned logit per query head in the softmax denominator) are computed: the merged output is rescaled by
# ``exp(lse - logaddexp(lse, sink))`` (``runtime.sp.ring``). Any other tensor or float (a logit ``softcap``, ...)
# would change the softmax in a way ring attention does not compute: it is refused, not ignored.
HONOURED_KWARGS = frozenset(
    {
        "s_aux",
        "dropout",  # refused below when non-zero
        "scaling",
        "sliding_window",
        "position_ids",
        "cache_position",
        "cu_seq_lens_q",
        "cu_seq_lens_k",
        "max_length_q",
        "max_length_k",
        "token_mask",
        "num_items_in_batch",  # the loss's denominator, handed down with the model's kwargs: no softmax input
    }
)


def _unhonoured(kwargs: dict[str, Any]) -> list[str]:
    return sorted(
        key
        for key, value in kwargs.items()
        if key not in HONOURED_KWARGS and isinstance(value, torch.Tensor | float) and not isinstance(value, bool)
    )


def _refuse(module: torch.nn.Module, kwargs: dict[str, Any]) -> None:
    if kwargs.get("dropout", 0.0):
        raise ValueError("ring attention does not support attention dropout; set the model's attention_dropout to 0")
    unhonoured = _unhonoured(kwargs)
    if unhonoured:
        raise LayoutRefused(
            f"ring attention (parallel.ring > 1) does not compute what {type(module).__name__} asks of its attention: "
            f"{', '.join(unhonoured)} (e.g. attention sinks or a logit softcap change the softmax); train this model "
            f"with parallel.ring: 1 (Ulysses only)"
        )
    if getattr(module, "is_causal", True) is not True:
        raise ValueError(f"ring attention serves causal language models; {type(module).__name__} is not causal")


def usp_attention(inner: str):
    def forward(
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        mark_site(module)
        _refuse(module, kwargs)
        if not isinstance(attention_mask, RingMask):
            raise ValueError(f"ring attention builds its masks itself; got a {type(attention_mask).__name__} mask")
        state = get_parallel_state()
        position_ids = kwargs.get("position_ids")
        full = query.shape[2] * state.sp_size
        if position_ids is None or position_ids.ndim != 2 or position_ids.shape[-1] != full:
            got = None if position_ids is None else tuple(position_ids.shape)
            raise ValueError(f"ring attention needs the global (b, {full}) text position ids, got {got}")
        group, ulysses = state.ulysses_group, state.ulysses_size
        repeat = kv_repeat_factor(query.shape[1], key.shape[1], ulysses)
        key, value = repeat_kv_heads(key, repeat), repeat_kv_heads(value, repeat)
        # (b, h, s/sp, d) -> (b, h/u, s/ring, d): the ring rank's chunk for this rank's heads
        query, key, value = seq_to_heads((query, key, value), seq_dim=2, head_dim=1, group=group)
        ring = state.ring_size
        index = torch.stack([zigzag_indices(full, ring, r) for r in range(ring)])
        docs = segment_ids(position_ids.to(query.device), attention_mask)
        doc_ids = None if docs is None else torch.stack([docs[:, i] for i in index.to(docs.device)])
        sink = heads_of_rank(kwargs, query.shape[1] * ulysses, ulysses, state.ulysses_rank).get("s_aux")
        scale = kwargs.get("scaling") or module.scaling
        out = ring_attention(
            query,
            key,
            value,
            group=state.ring_group,
            causal=True,
            scale=scale,
            index=index,
            doc_ids=doc_ids,
            window=attention_mask.window,
            sink=sink,
        )
        # (b, h/u, s/ring, d) -> (b, s/ring, h/u, d) -> (b, s/sp, h, d)
        return gather_heads_scatter_seq(out.transpose(1, 2), head_dim=2, seq_dim=1, group=group), None

    forward.__name__ = f"{PREFIX}{inner}"
    forward.local_attention = inner  # what a rank would run alone (the self-check plants it: self_check_power)
    return forward


def usp_attn_implementation(name: str) -> str:
    """The registered ``usp_<name>`` (registering it on first use)."""
    wrapped = PREFIX + name
    if wrapped not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(wrapped, usp_attention(name))
    return wrapped

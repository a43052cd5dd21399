"""SP handling of position information: RoPE tables and attention masks are built for the whole sequence.

Under Ulysses SP every rank holds 1/sp of the tokens but attention runs over the full sequence, so position
ids stay global (the collator never slices them) and each rank keeps its own slice of the RoPE table.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch

from runtime.parallel.collectives import slice_for_rank
from runtime.parallel.state import get_parallel_state
from runtime.sp.layout import rank_token_index


def slice_position_embeddings(
    position_embeddings: tuple[torch.Tensor, ...] | torch.Tensor, seq_dim: int = 1, form: str = "pair"
) -> tuple[torch.Tensor, ...] | torch.Tensor:
    """Keep this SP rank's slice of the RoPE tables computed from global position ids: a ``(cos, sin)`` pair
    (``form = "pair"``, most models) or one tensor (``form = "tensor"``: complex frequencies, Llama 4's
    ``freqs_cis``). The form is the spec's statement (``sp/rope_slice``' ``form``), checked here: iterating one
    tensor as a pair would slice its batch rows instead of its positions."""
    one = isinstance(position_embeddings, torch.Tensor)
    if one != (form == "tensor"):
        shape = tuple(position_embeddings.shape) if one else None
        found = f"one tensor of shape {shape}" if one else f"a {type(position_embeddings).__name__}"
        raise ValueError(
            f"sp/rope_slice: the RoPE tables are {found}, but the patch states form = {form!r}; state form = "
            f"{'tensor' if one else 'pair'!r} in the spec's sp/rope_slice patch"
        )
    state = get_parallel_state()
    if not state.sp_enabled:
        return position_embeddings
    tables = (position_embeddings,) if one else tuple(position_embeddings)
    if state.ring_enabled:  # this rank's zigzag chunks (runtime.sp.layout)
        length = tables[0].shape[seq_dim]
        index = rank_token_index(length, state.sp_size, state.ring_size, state.sp_rank)
        sliced = tuple(t.index_select(seq_dim, index.to(t.device)) for t in tables)
    else:
        sliced = tuple(slice_for_rank(t, seq_dim, state.sp_group) for t in tables)
    return sliced[0] if one else sliced


@dataclass(frozen=True)
class RingMask:
    """What a mask builder stands for under ring attention, instead of an ``L x L`` tensor: causal, with this
    sliding ``window`` (None: none); documents come from the global position ids (``runtime.sp.usp``) when the
    model's mask builder saw them (``documents``), as transformers finds packed documents only then; ``chunk``:
    chunked attention (Llama 4), a query sees only keys of its own block of ``chunk`` tokens counted from the row's
    first token (transformers' ``chunked_overlay``), within its document."""

    window: int | None = None
    documents: bool = True
    chunk: int | None = None


RING_MASK_BUILDERS = ("create_causal_mask", "create_sliding_window_causal_mask", "create_chunked_causal_mask")


def _ring_mask(make_mask: Callable[..., Any], config: Any, documents: bool = True) -> RingMask:
    name = getattr(make_mask, "__name__", repr(make_mask))
    if name not in RING_MASK_BUILDERS:
        raise ValueError(f"ring attention (parallel.ring > 1) supports the masks {RING_MASK_BUILDERS}, not {name}")
    window = config.sliding_window if name == "create_sliding_window_causal_mask" else None
    chunk = config.attention_chunk_size if name == "create_chunked_causal_mask" else None
    return RingMask(window, documents, chunk)


_DOCUMENTS: ContextVar[bool] = ContextVar("documents_from_position_ids", default=False)


@contextmanager
def documents_from_position_ids() -> Iterator[None]:
    """Within it, the forward's position ids reach the mask builders of a model that calls them without (gpt_oss,
    whose spec hands them to ``full_sequence_mask``), so transformers finds the packed documents of a row from
    them (a row of one document: the mask upstream builds). Outside it the mask stays upstream's, which lets packed
    documents attend to each other: the trainer enters it for a record stating ``[model.data] packed_documents =
    "position_ids"`` (``runtime.train.text_step``)."""
    token = _DOCUMENTS.set(True)
    try:
        yield
    finally:
        _DOCUMENTS.reset(token)


def _given_positions(make_mask: Callable[..., Any], position_ids: torch.Tensor) -> Callable[..., Any]:
    def make_document_mask(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("position_ids") is None:
            kwargs["position_ids"] = position_ids
        return make_mask(*args, **kwargs)

    return make_document_mask


def full_sequence_mask(make_mask: Callable[..., Any], position_ids: torch.Tensor | None = None) -> Callable[..., Any]:
    """Build the attention mask for the full (gathered) sequence that Ulysses attention sees.

    Mask builders only read the shape, dtype and device of `inputs_embeds`, so a zero-copy expanded view of
    the local embeddings stands in for the full sequence. ``position_ids``: the forward's, for a model that calls
    its mask builders without them (gpt_oss): outside ``documents_from_position_ids`` they give the global length
    only and the mask stays upstream's (no document boundaries, under a ring too); inside it they reach the
    builders (or the ring's mask) as documents, with SP off too.
    """
    state = get_parallel_state()
    given = position_ids is not None and _DOCUMENTS.get()
    if not state.sp_enabled:
        return _given_positions(make_mask, position_ids) if given else make_mask
    outside = position_ids

    def make_full_mask(*args: Any, **kwargs: Any) -> Any:
        embeds = kwargs["inputs_embeds"]
        full = embeds.shape[1] * state.sp_size
        if given and kwargs.get("position_ids") is None:
            kwargs["position_ids"] = outside
        documents = kwargs.get("position_ids") is not None
        position_ids = kwargs.get("position_ids") if documents else outside
        if position_ids is None or position_ids.shape[-1] != full:
            got = None if position_ids is None else tuple(position_ids.shape)
            raise ValueError(
                f"sequence parallel (sp={state.sp_size}) needs global position_ids of length {full} "
                f"(local length {embeds.shape[1]} x sp), got {got}; the SP collator provides them"
            )
        if kwargs.get("past_key_values") is not None:
            raise ValueError("sequence parallel training does not support a KV cache (past_key_values)")
        if state.ring_enabled:  # ring attention masks block by block (runtime.sp.usp): no L x L tensor
            return _ring_mask(make_mask, kwargs["config"], documents)
        kwargs["inputs_embeds"] = embeds[:, :1].expand(embeds.shape[0], full, *embeds.shape[2:])
        return make_mask(*args, **kwargs)

    return make_full_mask

"""SP hooks of vision-language models: the ViT runs on 1/sp of the patches, the LM gets its own visual tokens.

Flow under Ulysses SP (every hook is the identity when SP is off, so generated VLMs stay bitwise equal to upstream):

1. ``vit_pad_length`` / ``vit_pad_and_slice`` / ``vit_pad_cu_seqlens``: after the patch embedding the ViT's patch
   tensors (hidden states, rotary cos/sin) are padded to a multiple of ``sp * pad_scale`` and each rank keeps its
   contiguous slice. ``pad_scale`` is the spatial merge unit (merge_size**2), so a merger group never straddles two
   ranks. The padding is one extra segment appended to ``cu_seqlens``: varlen attention sees it as its own image
   and no real patch attends to it.
2. ``vit_all_to_all``: inside ViT attention, Ulysses all-to-all (local patches x all heads <-> all patches x
   this rank's heads) around the per-image attention, which needs the whole sequence to split it by cu_seqlens.
3. ``vit_gather``: after the merger, every rank gathers the merged tokens (and every deepstack level) and drops
   the padding, so the vision output is the full, unpadded one, as upstream returns it.
4. ``local_visual_tokens``: the LM side keeps the visual tokens that fall into this rank's slice of the sequence,
   in the order ``masked_scatter`` fills them (row-major over the *global* sequence).

Multimodal position ids need no hook: the data pipeline hands the model upstream's own layout (see
``runtime/data/sp_batch.py``), so nothing here ever reshapes or reinterprets them.

Gradients follow ``runtime.parallel.collectives``' partial-gradient convention: ``vit_gather`` backward
reduce-scatters, so each rank gets the complete gradient of its own patches.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from runtime.parallel.collectives import (
    gather_along_dim,
    gather_heads_scatter_seq_many,
    gather_seq_scatter_heads_many,
    slice_for_rank,
    unpad,
)
from runtime.parallel.sites import mark_site
from runtime.parallel.state import get_parallel_state
from runtime.sp.layout import rank_token_index, to_natural_order

__all__ = [
    "local_visual_tokens",
    "vit_all_to_all",
    "vit_gather",
    "vit_pad_and_slice",
    "vit_pad_cu_seqlens",
    "vit_pad_length",
]


def _sp_group() -> Any:
    state = get_parallel_state()
    return state.sp_group if state.sp_enabled else None


def vit_pad_length(num_patches: int, pad_scale: int = 1) -> int:
    """Padding that makes ``num_patches`` a multiple of ``sp * pad_scale``; 0 when SP is off."""
    state = get_parallel_state()
    if not state.sp_enabled:
        return 0
    if pad_scale < 1:
        raise ValueError(f"vit_pad_length: pad_scale must be >= 1, got {pad_scale}")
    return -num_patches % (state.sp_size * pad_scale)


def _pad_and_slice_one(x: Tensor, pad_len: int, dim: int) -> Tensor:
    if pad_len:
        shape = list(x.shape)
        shape[dim] = pad_len
        x = torch.cat([x, x.new_zeros(shape)], dim=dim)
    return slice_for_rank(x, dim, _sp_group())


def vit_pad_and_slice(x: Any, pad_len: int, dim: int = 0) -> Any:
    """This rank's slice of a patch tensor (or a tuple/list of them, e.g. RoPE (cos, sin)) padded by ``pad_len``.

    Returns ``x`` itself when SP is off.
    """
    if not get_parallel_state().sp_enabled:
        return x
    if isinstance(x, (tuple, list)):
        return type(x)(_pad_and_slice_one(t, pad_len, dim) for t in x)
    return _pad_and_slice_one(x, pad_len, dim)


def vit_pad_cu_seqlens(cu_seqlens: Tensor, pad_len: int) -> Tensor:
    """Append the padding segment (``cu_seqlens[-1] + pad_len``) so varlen attention covers the padded length."""
    if not pad_len:
        return cu_seqlens
    return torch.cat([cu_seqlens, cu_seqlens[-1:] + pad_len])


def vit_all_to_all(
    tensors: tuple[Tensor, ...], to: str, seq_dim: int, head_dim: int, module: Any = None
) -> tuple[Tensor, ...]:
    """Ulysses all-to-all of ViT attention tensors: ``to="heads"`` before attention (local patches x all heads ->
    all patches x this rank's heads), ``to="sequence"`` after it (the inverse). Identity when SP is off.
    ``module``: the attention module of the call, marked as having passed a checked site
    (``runtime.parallel.sites``)."""
    mark_site(module)
    group = _sp_group()
    if group is None:
        return tuple(tensors)
    if to == "heads":  # q, k and v in one all-to-all
        return gather_seq_scatter_heads_many(tensors, seq_dim=seq_dim, head_dim=head_dim, group=group)
    if to == "sequence":
        return gather_heads_scatter_seq_many(tensors, head_dim=head_dim, seq_dim=seq_dim, group=group)
    raise ValueError(f"vit_all_to_all: to must be 'heads' or 'sequence', got {to!r}")


def vit_gather(x: Any, pad_len: int, dim: int = 0) -> Any:
    """Gather every rank's slice of ``x`` (a tensor or a list of tensors, e.g. the deepstack levels) along
    ``dim`` and drop the last ``pad_len`` (padding) entries. Returns ``x`` itself when SP is off."""
    group = _sp_group()
    if group is None:
        return x
    if isinstance(x, (tuple, list)):
        return type(x)(unpad(gather_along_dim(t, dim, group), dim, pad_len) for t in x)
    return unpad(gather_along_dim(x, dim, group), dim, pad_len)


def _local_token_index(local_mask: Tensor) -> Tensor:
    """Indices, into the global (row-major over the full sequence) list of visual tokens, of this rank's ones."""
    state = get_parallel_state()
    full = gather_along_dim(local_mask.to(torch.int32), 1, state.sp_group).bool()
    full = to_natural_order(full, 1, state.sp_size, state.ring_size)  # under a ring ranks hold zigzag chunks
    ordinal = (full.reshape(-1).cumsum(0) - 1).reshape(full.shape)
    local_len = local_mask.shape[1]
    if state.ring_enabled:
        index = rank_token_index(full.shape[1], state.sp_size, state.ring_size, state.sp_rank)
        return ordinal[:, index.to(ordinal.device)][local_mask]
    return ordinal.narrow(1, state.sp_rank * local_len, local_len)[local_mask]


def local_visual_tokens(local_mask: Tensor, *embeds: Any) -> tuple[Any, ...]:
    """Keep, of each full visual-token tensor (or list of them: deepstack levels), the rows that this rank's
    slice of the sequence holds. ``local_mask`` is (bs, local_len) bool (a trailing singleton dim is dropped).

    Returns ``embeds`` unchanged when SP is off.
    """
    if not get_parallel_state().sp_enabled:
        return embeds
    if local_mask.ndim == 3:
        local_mask = local_mask[..., 0]
    index = _local_token_index(local_mask).to(next(_tensors(embeds)).device)

    def pick(x: Any) -> Any:
        if isinstance(x, (tuple, list)):
            return type(x)(pick(t) for t in x)
        return x.index_select(0, index)

    def pick_level(x: Any) -> Any:
        """A deepstack level given as one tensor per image or video (transformers >= 5.23 splits them): the rows of
        their concatenation, as the one piece of a sequence of the same type (upstream concatenates it next)."""
        if isinstance(x, (tuple, list)) and x and all(isinstance(t, (tuple, list)) for t in x):
            return type(x)(type(level)([torch.cat(tuple(level)).index_select(0, index)]) for level in x)
        return pick(x)

    return tuple(pick_level(e) for e in embeds)


def _tensors(items: Any):
    for item in items:
        if isinstance(item, (tuple, list)):
            yield from _tensors(item)
        else:
            yield item

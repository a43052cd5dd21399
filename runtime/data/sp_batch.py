"""Turn a packed batch into what one SP rank feeds the model.

Position ids are computed on the full row and stay global (RoPE and masks need them); token tensors are
padded to a multiple of sp with a separate padding segment and sliced per rank.

The same functions serve text rows and multimodal rows. Position ids come in exactly one layout per kind, the one the
upstream model itself takes (``check_position_ids`` enforces it; nothing anywhere infers a layout from a shape):

- text rows: ``(bs, L)``;
- multimodal rows: ``(4, bs, L)``, channels first as upstream's ``get_rope_index`` / ``generate`` build them, with
  channel 0 the text positions (restarting per packed sample; they drive the packing mask) and channels 1-3 the
  M-RoPE T/H/W ids. Padding gets ``0..pad-1`` on every channel.

Under SP each rank also gets ``token_mask``, its slice of the row's real-token mask (False on the padding segment).
``mm_token_type_ids`` is a token tensor like ``input_ids``, and the vision inputs (pixel values, grids) pass through
whole, because every SP rank runs the ViT hooks on all patches.
"""

from __future__ import annotations

import torch

from runtime.parallel.state import ParallelState
from runtime.sp.layout import pad_multiple, rank_token_index

IGNORE_INDEX = -100
SEQUENCE_KEYS = ("input_ids", "labels", "mm_token_type_ids")
MROPE_CHANNELS = 4  # text row + T/H/W
TOKEN_MASK = "token_mask"  # the model keyword marking real tokens (see shard_row)


def check_position_ids(batch: dict[str, torch.Tensor]) -> None:
    """Raise unless ``batch["position_ids"]`` is int64 ``(bs, L)`` (text) or ``(4, bs, L)`` (multimodal, upstream's
    channels-first layout) for ``input_ids`` of shape ``(bs, L)``. A wrong layout is an error, never transposed."""
    ids, positions = batch["input_ids"], batch.get("position_ids")
    if positions is None:
        raise ValueError("the batch has no position_ids; the packing collators compute them per sample")
    expected = tuple(ids.shape) if positions.ndim == 2 else (MROPE_CHANNELS, *ids.shape)
    if tuple(positions.shape) != expected or positions.dtype != torch.long:
        raise ValueError(
            f"position_ids must be int64 (bs, L) for text rows or ({MROPE_CHANNELS}, bs, L) for multimodal rows "
            f"(channels first, as upstream's get_rope_index returns them: text row, then T/H/W); for input_ids "
            f"{tuple(ids.shape)} that is {expected}, got {tuple(positions.shape)} {positions.dtype}"
        )


def pad_to_multiple(batch: dict[str, torch.Tensor], multiple: int, pad_token_id: int = 0) -> dict[str, torch.Tensor]:
    """Append a padding segment (own position ids from 0, labels ignored) so the row length divides `multiple`.

    Token tensors (``SEQUENCE_KEYS`` present in the batch) are padded with the pad token, ``IGNORE_INDEX`` and text
    type 0; position ids with ``0..pad-1`` on every channel; anything else passes through unchanged.
    """
    pad = -batch["input_ids"].shape[-1] % multiple
    if pad == 0:
        return dict(batch)
    fill = {"input_ids": pad_token_id, "labels": IGNORE_INDEX, "mm_token_type_ids": 0}
    out = dict(batch)
    for key in SEQUENCE_KEYS:
        if key in batch:
            v = batch[key]
            out[key] = torch.cat([v, torch.full((v.shape[0], pad), fill[key], dtype=v.dtype)], 1)
    positions = batch["position_ids"]
    out["position_ids"] = torch.cat([positions, torch.arange(pad).expand(*positions.shape[:-1], pad)], -1)
    return out


def shard_row(
    batch: dict[str, torch.Tensor], sp_size: int, sp_rank: int, ring_size: int = 1
) -> dict[str, torch.Tensor]:
    """SP rank ``sp_rank``'s inputs: the padded row's contiguous slice of each token tensor, the rest whole.

    With a ring (``ring_size > 1``) the row is padded to a multiple of ``2 * sp_size`` and the rank's tokens are its
    zigzag chunks (``runtime.sp.layout.rank_token_index``: equal causal work over the ring).

    With ``sp_size > 1`` the result also holds ``token_mask`` (bool, sliced like the tokens): True on the row's own
    tokens, False on the padding segment. The model takes it as a keyword; the MoE load-balancing loss counts only
    the marked tokens (``runtime.moe.hooks.global_aux_loss``), so padding never changes a loss or a gradient.
    """
    if not 0 <= sp_rank < sp_size:
        raise ValueError(f"need 0 <= sp_rank < sp_size, got sp_rank={sp_rank}, sp_size={sp_size}")
    check_position_ids(batch)
    padded = pad_to_multiple(batch, pad_multiple(sp_size, ring_size))
    keys = SEQUENCE_KEYS
    if sp_size > 1:
        mask = torch.zeros(padded["input_ids"].shape, dtype=torch.bool)
        mask[:, : batch["input_ids"].shape[1]] = True
        padded[TOKEN_MASK] = mask
        keys = (*SEQUENCE_KEYS, TOKEN_MASK)
    if ring_size > 1:
        index = rank_token_index(padded["input_ids"].shape[1], sp_size, ring_size, sp_rank)
        return {k: v[:, index] if k in keys else v for k, v in padded.items()}  # advanced indexing copies
    chunk = padded["input_ids"].shape[1] // sp_size
    # A copy, not a view: in-place edits of one rank's slice must not reach the full row.
    return {k: v[:, sp_rank * chunk : (sp_rank + 1) * chunk].clone() if k in keys else v for k, v in padded.items()}


def shard_for_sp(batch: dict[str, torch.Tensor], state: ParallelState) -> dict[str, torch.Tensor]:
    """This rank's model inputs: its slice of the token tensors, the global position ids, whole vision inputs."""
    return shard_row(batch, state.sp_size, state.sp_rank, state.ring_size)


def packed_attention_kwargs(position_ids: torch.Tensor) -> dict[str, torch.Tensor | int]:
    """Flash-attention varlen kwargs of a packed row, from its (global, padded) position ids, computed on the host.

    Each packed sample (and the SP padding segment) restarts its text positions at 0, so the segment starts are where
    the position is 0. Without these kwargs transformers derives them from ``position_ids`` inside the forward
    (a device->host sync per step); with them the LM's attention reads them as given. Under SP they describe the
    full row, which is what Ulysses attention sees. Only for ``bs == 1`` rows (what the packed loaders yield).
    """
    text = position_ids[0] if position_ids.ndim == 3 else position_ids  # multimodal: channel 0 is the text row
    if text.shape[0] != 1:
        raise ValueError(f"packed_attention_kwargs: expected one packed row, got batch size {text.shape[0]}")
    text = text[0].to("cpu")
    starts = torch.nonzero(text == 0).flatten()
    if starts.numel() == 0 or starts[0] != 0:
        raise ValueError("packed_attention_kwargs: the row's text positions must start at 0")
    cu = torch.cat([starts, torch.tensor([text.numel()])]).to(torch.int32)
    longest = int((cu[1:] - cu[:-1]).max())
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}

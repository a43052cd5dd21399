"""Pack tokenized multimodal samples into one row, the VLM counterpart of ``pack_row``.

Rows are planned by the same ``plan_rows`` (through ``PackedRowSampler``). Unlike text, a multimodal sample is never
truncated: cutting it could split an image's tokens from its patches, so the loader drops over-long samples instead.
Each sample's position ids restart at 0 on all four channels (the text row drives the packing mask, the M-RoPE rows
were computed per sample), and each sample's first label is ``IGNORE_INDEX`` for the reason ``packing.py`` gives.
The vision tensors are concatenated in sample order, which is the order in which the model meets their tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from runtime.data.multimodal import VISION_KEYS, MultimodalSample
from runtime.data.packing import check_token_budget
from runtime.data.sp_batch import IGNORE_INDEX


def has_multimodal_targets(sample: MultimodalSample, token_budget: int) -> bool:
    """Whether the sample fits the budget whole and, with its first label masked, still has a token to learn."""
    return len(sample) <= token_budget and bool((sample.labels[1:] != IGNORE_INDEX).any())


def pack_multimodal_row(samples: Sequence[MultimodalSample], token_budget: int) -> dict[str, torch.Tensor]:
    """One ``(1, L)`` batch: input_ids, labels, mm_token_type_ids, position_ids ``(4, 1, L)`` (upstream's layout,
    see ``runtime/data/sp_batch.py``), and the vision
    tensors that any sample has (pixel_values, image_grid_thw, pixel_values_videos, video_grid_thw,
    second_per_grid_ts), concatenated in sample order; keys no sample has are left out."""
    check_token_budget(token_budget)
    if not samples:
        raise ValueError("a row needs at least one sample")
    total = sum(len(s) for s in samples)
    if total > token_budget:
        raise ValueError(
            f"the samples hold {total} tokens, more than the budget of {token_budget} "
            f"(multimodal samples are never truncated)"
        )
    labels = []
    for sample in samples:
        own = sample.labels.clone()
        own[0] = IGNORE_INDEX  # nobody's target: see the module docstring
        labels.append(own)
    row = {
        "input_ids": torch.cat([s.input_ids for s in samples])[None],
        "labels": torch.cat(labels)[None],
        "mm_token_type_ids": torch.cat([s.mm_token_type_ids for s in samples])[None],
        "position_ids": torch.cat([s.position_ids for s in samples], dim=1)[:, None],
    }
    for key in VISION_KEYS:
        parts = [getattr(s, key) for s in samples if getattr(s, key) is not None]
        if parts:
            row[key] = torch.cat(parts)
    return row

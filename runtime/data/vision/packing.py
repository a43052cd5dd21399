"""Pack tokenized multimodal samples into one row, the VLM counterpart of text's ``pack_row``, and the VLM trainer's
loader.

Rows are planned by the same ``plan_rows`` (``runtime/data/loader.py``). Unlike text, a multimodal sample is never
truncated: cutting it could split an image's tokens from its patches, so the loader drops over-long samples instead
(``WholeSampleLoader``). Each sample's position ids restart at 0 on all four channels (the text row drives the packing
mask, the M-RoPE rows were computed per sample), and each sample's first label is ``IGNORE_INDEX`` for the reason
``text/packing.py`` gives. The vision tensors are concatenated in sample order, which is the order in which the model
meets their tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from runtime.data.loader import WholeSampleLoader, whole_labels
from runtime.data.vision.tokenization import VISION_KEYS, MultimodalSample


def pack_multimodal_row(samples: Sequence[MultimodalSample], token_budget: int) -> dict[str, torch.Tensor]:
    """One ``(1, L)`` batch: input_ids, labels, mm_token_type_ids, position_ids ``(4, 1, L)`` (upstream's layout,
    see ``runtime/data/sp_batch.py``), and the vision
    tensors that any sample has (pixel_values, image_grid_thw, pixel_values_videos, video_grid_thw,
    second_per_grid_ts), concatenated in sample order; keys no sample has are left out."""
    labels = whole_labels(samples, token_budget)
    row = {
        "input_ids": torch.cat([s.input_ids for s in samples])[None],
        "labels": labels,
        "mm_token_type_ids": torch.cat([s.mm_token_type_ids for s in samples])[None],
        "position_ids": torch.cat([s.position_ids for s in samples], dim=1)[:, None],
    }
    for key in VISION_KEYS:
        parts = [getattr(s, key) for s in samples if getattr(s, key) is not None]
        if parts:
            row[key] = torch.cat(parts)
    return row


class MultimodalPackedLoader(WholeSampleLoader):
    """Yields ``pack_multimodal_row`` batches: token tensors ``(1, L)``, position_ids ``(4, 1, L)``, vision tensors."""

    def pack(self, samples: Sequence[MultimodalSample]) -> dict[str, torch.Tensor]:
        return pack_multimodal_row(samples, self.token_budget)

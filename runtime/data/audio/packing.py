"""Pack tokenized omni samples into one row, and the loader that yields such rows.

As ``vision/packing.py`` for the VLMs (never truncated, first label of each sample ignored, media concatenated in
sample order), with two differences:

- **Position ids in the model's layout, stated**: ``(4, 1, L)``, channels first (text row, then T/H/W), which is the
  layout Qwen3-Omni's text model reads (the runtime's one multimodal layout, docs/parallelism.md). No
  model-side hook guesses a layout from the shape; the SP collator pads the last dim whatever the layout.
- **Mel features** ``(audios, mel, frames)`` of different samples are padded to the row's longest audio, with
  ``feature_attention_mask`` 0 on the padding (the model selects each audio's frames by that mask).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from runtime.data.audio.tokenization import MEDIA_KEYS, OmniSample
from runtime.data.loader import WholeSampleLoader, whole_labels

__all__ = ["POSITION_IDS_LAYOUT", "OmniPackedLoader", "pack_omni_row", "text_positions"]

POSITION_IDS_LAYOUT = "channels_first"


def text_positions(position_ids: torch.Tensor) -> torch.Tensor:
    """The text row ``(1, L)`` of a row's ``(4, 1, L)`` ids (what packed flash-attention kwargs are derived from)."""
    return position_ids[0]


def _pad_frames(x: torch.Tensor, frames: int) -> torch.Tensor:
    return F.pad(x, (0, frames - x.shape[-1]))


def pack_omni_row(samples: Sequence[OmniSample], token_budget: int) -> dict[str, torch.Tensor]:
    """One row: input_ids and labels ``(1, L)``, position_ids ``(4, 1, L)``, and the media any sample has."""
    labels = whole_labels(samples, token_budget)
    row = {
        "input_ids": torch.cat([s.input_ids for s in samples])[None],
        "labels": labels,
        "position_ids": torch.cat([s.position_ids for s in samples], dim=1)[:, None],
    }
    audio = [s for s in samples if s.input_features is not None]
    frames = max((s.input_features.shape[-1] for s in audio), default=0)
    for key in MEDIA_KEYS:
        parts = [getattr(s, key) for s in samples if getattr(s, key) is not None]
        if key in ("input_features", "feature_attention_mask"):
            parts = [_pad_frames(p, frames) for p in parts]
        if parts:
            row[key] = torch.cat(parts)
    return row


class OmniPackedLoader(WholeSampleLoader):
    """Yields ``pack_omni_row`` batches; which samples are kept, order, DP sharding and resume are the loader's."""

    def pack(self, samples: Sequence[OmniSample]) -> dict[str, torch.Tensor]:
        return pack_omni_row(samples, self.token_budget)

"""Pack tokenized omni samples into one row, and the loader that yields such rows.

As ``multimodal_packing`` for the VLMs (never truncated, first label of each sample ignored, media concatenated in
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

from runtime.data.loader import PackedLoader
from runtime.data.omni import MEDIA_KEYS, OmniSample
from runtime.data.packing import check_token_budget
from runtime.data.sp_batch import IGNORE_INDEX

__all__ = ["POSITION_IDS_LAYOUT", "OmniPackedLoader", "has_omni_targets", "pack_omni_row", "text_positions"]

POSITION_IDS_LAYOUT = "channels_first"


def text_positions(position_ids: torch.Tensor) -> torch.Tensor:
    """The text row ``(1, L)`` of a row's ``(4, 1, L)`` ids (what packed flash-attention kwargs are derived from)."""
    return position_ids[0]


def has_omni_targets(sample: OmniSample, token_budget: int) -> bool:
    """Whether the sample fits the budget whole and, with its first label masked, still has a token to learn."""
    return len(sample) <= token_budget and bool((sample.labels[1:] != IGNORE_INDEX).any())


def _pad_frames(x: torch.Tensor, frames: int) -> torch.Tensor:
    return F.pad(x, (0, frames - x.shape[-1]))


def pack_omni_row(samples: Sequence[OmniSample], token_budget: int) -> dict[str, torch.Tensor]:
    """One row: input_ids and labels ``(1, L)``, position_ids ``(4, 1, L)``, and the media any sample has."""
    check_token_budget(token_budget)
    if not samples:
        raise ValueError("a row needs at least one sample")
    total = sum(len(s) for s in samples)
    if total > token_budget:
        raise ValueError(f"the samples hold {total} tokens, more than the budget of {token_budget} (never truncated)")
    labels = []
    for sample in samples:
        own = sample.labels.clone()
        own[0] = IGNORE_INDEX
        labels.append(own)
    row = {
        "input_ids": torch.cat([s.input_ids for s in samples])[None],
        "labels": torch.cat(labels)[None],
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


class OmniPackedLoader(PackedLoader):
    """Yields ``pack_omni_row`` batches; order, DP sharding and resume are ``PackedLoader``'s."""

    requirement = "fits whole and has a training target within"

    def keeps(self, sample: OmniSample) -> bool:
        return has_omni_targets(sample, self.token_budget)

    def pack(self, samples: Sequence[OmniSample]) -> dict[str, torch.Tensor]:
        return pack_omni_row(samples, self.token_budget)

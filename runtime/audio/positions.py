"""The M-RoPE position-id function of omni models, for the data pipeline, without building the model.

Qwen3-Omni's ``get_rope_index`` extends Qwen-VL's: an audio's tokens get consecutive positions (their count is the
encoder's output length for the audio's mel frames), and a video whose audio track is given as well
(``use_audio_in_video``) interleaves its video and audio tokens by time, between two pairs of start/end markers.
As for the VLMs (``runtime.vlm.positions``), the ids are computed per whole sample before packing and SP slicing, by
upstream's own ``get_rope_index`` bound to a weightless stand-in that carries only the config, so a data worker can
run (and pickle) it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from runtime.vlm.positions import _ConfigOnly

__all__ = ["OmniRopeIndexFunction"]


class _OmniHost(_ConfigOnly):
    """``self`` for an omni ``get_rope_index``: the config, and the merge size the model's ``__init__`` copies."""

    def __init__(self, model_cls: type, config: Any) -> None:
        super().__init__(model_cls, config)
        self.spatial_merge_size = config.vision_config.spatial_merge_size


@dataclass(frozen=True)
class OmniRopeIndexFunction:
    """``fn(input_ids (1, L), image_grid_thw, video_grid_thw, audio_lengths, use_audio_in_video,
    video_second_per_grid) -> (3, 1, L)``: the first value of ``model_cls.get_rope_index`` for one sample.

    ``audio_lengths`` are the mel-frame counts of the sample's audios in order of appearance (a video's audio track
    at the video's place), ``video_second_per_grid`` the seconds one temporal patch of each video spans.
    """

    model_cls: type
    config: Any

    def __call__(
        self,
        input_ids: Tensor,
        image_grid_thw: Tensor | None = None,
        video_grid_thw: Tensor | None = None,
        audio_lengths: Tensor | None = None,
        use_audio_in_video: bool = False,
        video_second_per_grid: Tensor | None = None,
    ) -> Tensor:
        if input_ids.ndim != 2 or input_ids.shape[0] != 1:
            raise ValueError(f"OmniRopeIndexFunction takes one sample, (1, L) ids; got {tuple(input_ids.shape)}")
        host = _OmniHost(self.model_cls, self.config)
        # upstream reads the attention mask on both of its paths; a sample has no padding
        attention_mask = torch.ones_like(input_ids)
        position_ids, _ = self.model_cls.get_rope_index(
            host,
            input_ids,
            image_grid_thw,
            video_grid_thw,
            attention_mask,
            use_audio_in_video,
            audio_lengths,
            video_second_per_grid,
        )
        return position_ids

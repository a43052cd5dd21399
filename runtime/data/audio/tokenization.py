"""Chat samples with images, videos and audio -> model-ready tensors for omni models (Qwen3-Omni's thinker).

The counterpart of ``runtime/data/vision/tokenization.py`` for samples that may hold audio:

- **Audio parts** (``{"type": "audio", "audio": "clip.flac"}``) are decoded and resampled to the feature
  extractor's rate (``audio/waveforms.py``) and turned into log-mel frames by the processor's Whisper feature
  extractor, all audios of a sample in one call, exactly as the processor's ``__call__`` does.
- **A video with its audio track** (``{"type": "video", "video": [frames], "audio": "track.wav"}``): the track is one
  more audio, at the video's place in the order of audios, and the sample is tokenized with upstream's
  ``use_audio_in_video`` layout (video and audio tokens interleaved by time inside one vision block). Upstream
  decides that layout per call, so a sample's videos either all have a track or none does (an error otherwise).
- **Placeholders** expand through the processor's own ``replace_multimodal_special_tokens`` (so the text equals its
  ``__call__``'s), with the model config's ``position_id_per_seconds`` and audio ``n_window``; labels come from the
  prefix rendering of ``assistant_spans`` as for the VLMs. Media tokens and their start/end markers carry no label.
- **Position ids** ``(4, L)``: the text row ``0..L-1``, then T/H/W from the model's ``get_position_id_func`` (the
  upstream ``get_rope_index`` with the audio lengths and the sample's ``use_audio_in_video``), per whole sample.

Videos are frames through the image processor (``vision/video.py``); ``video_second_per_grid`` is the temporal
patch over the fps, as upstream's processor computes it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from runtime.data.audio.processor import omni_token_ids
from runtime.data.audio.waveforms import load_audio
from runtime.data.samples import AudioPart, ChatSample, ImagePart, Sample, TextPart, TextSample, VideoPart
from runtime.data.sp_batch import IGNORE_INDEX
from runtime.data.text.tokenization import assistant_spans, encode_with_offsets, labels_from_spans, tokenize_text
from runtime.data.vision.tokenization import load_image
from runtime.data.vision.video import DEFAULT_VIDEO_FPS, video_inputs

__all__ = ["MEDIA_KEYS", "OmniSample", "omni_audio_token_counts", "tokenize_omni"]

MEDIA_KEYS = (
    "pixel_values",
    "image_grid_thw",
    "pixel_values_videos",
    "video_grid_thw",
    "video_second_per_grid",
    "input_features",
    "feature_attention_mask",
)
# fn(input_ids (1, L), image_grid_thw, video_grid_thw, audio_lengths, use_audio_in_video, video_second_per_grid)
PositionIdFunc = Callable[..., torch.Tensor]


@dataclass(frozen=True, eq=False)
class OmniSample:
    """One tokenized conversation with its media (None where the sample has none of a kind)."""

    input_ids: torch.Tensor  # (L,) long
    labels: torch.Tensor  # (L,) long
    position_ids: torch.Tensor  # (4, L) long: text position, then M-RoPE T/H/W
    pixel_values: torch.Tensor | None = None  # (image patches, D)
    image_grid_thw: torch.Tensor | None = None  # (images, 3)
    pixel_values_videos: torch.Tensor | None = None  # (video patches, D)
    video_grid_thw: torch.Tensor | None = None  # (videos, 3)
    video_second_per_grid: torch.Tensor | None = None  # (videos,) float
    input_features: torch.Tensor | None = None  # (audios, mel, frames) log-mel, padded to the longest audio
    feature_attention_mask: torch.Tensor | None = None  # (audios, frames) 1 on each audio's frames

    def __post_init__(self) -> None:
        length = self.input_ids.shape[-1]
        if length == 0 or self.input_ids.shape != (length,) or self.labels.shape != (length,):
            raise ValueError(f"input_ids and labels must be 1-D of one length, got {tuple(self.input_ids.shape)}")
        if self.position_ids.shape != (4, length):
            raise ValueError(f"position_ids must have shape (4, {length}), got {tuple(self.position_ids.shape)}")
        pairs = (
            ("pixel_values", "image_grid_thw"),
            ("pixel_values_videos", "video_grid_thw"),
            ("input_features", "feature_attention_mask"),
        )
        for a, b in pairs:
            if (getattr(self, a) is None) != (getattr(self, b) is None):
                raise ValueError(f"{a} and {b} must both be set or both be None")

    def __len__(self) -> int:
        return self.input_ids.shape[0]


def omni_audio_token_counts(feature_lengths: torch.Tensor, n_window: int) -> torch.Tensor:
    """Audio tokens per audio for its mel-frame count (the encoder's output length; upstream's formula)."""
    from transformers.models.qwen3_omni_moe.processing_qwen3_omni_moe import _get_feat_extract_output_lengths

    return _get_feat_extract_output_lengths(feature_lengths, n_window)


@dataclass
class _Media:
    images: list
    videos: list[tuple[list, float]]
    audio_paths: list
    with_track: list[bool]


def _media(sample: ChatSample) -> _Media:
    media = _Media([], [], [], [])
    for message in sample.messages:
        for part in () if isinstance(message.content, str) else message.content:
            if isinstance(part, ImagePart):
                media.images.append(load_image(part.path))
            elif isinstance(part, VideoPart):
                media.videos.append(([load_image(f) for f in part.frames], part.fps or DEFAULT_VIDEO_FPS))
                media.with_track.append(part.audio is not None)
                if part.audio is not None:
                    media.audio_paths.append(part.audio)
            elif isinstance(part, AudioPart):
                media.audio_paths.append(part.path)
    if len(set(media.with_track)) > 1:
        raise ValueError(
            "a sample's videos must all have an audio track or none (Qwen3-Omni lays a sample's videos out one "
            "way, use_audio_in_video); split the sample or drop the tracks"
        )
    return media


def _hf_messages(sample: ChatSample) -> list[dict[str, Any]]:
    kinds = {ImagePart: "image", VideoPart: "video", AudioPart: "audio"}
    return [
        {
            "role": m.role,
            "content": m.content
            if isinstance(m.content, str)
            else [
                {"type": "text", "text": p.text} if isinstance(p, TextPart) else {"type": kinds[type(p)]}
                for p in m.content
            ],
        }
        for m in sample.messages
    ]


def _check_count(ids: torch.Tensor, token_id: int, expected: int, what: str) -> None:
    found = int((ids == token_id).sum())
    if found != expected:
        raise ValueError(
            f"the tokenized sample has {found} {what} tokens but its {what}s need {expected}; does the chat template "
            f"place one placeholder per {what}?"
        )


def _position_ids(fn: PositionIdFunc, input_ids: torch.Tensor, media: dict, audio_lengths, in_video: bool):
    mrope = fn(
        input_ids[None],
        media.get("image_grid_thw"),
        media.get("video_grid_thw"),
        audio_lengths,
        in_video,
        media.get("video_second_per_grid"),
    )
    length = input_ids.shape[0]
    if tuple(mrope.shape) != (3, 1, length):
        raise ValueError(f"position_id_func must return ids of shape (3, 1, {length}), got {tuple(mrope.shape)}")
    return torch.cat([torch.arange(length)[None], mrope[:, 0].long()])


def tokenize_omni(sample: Sample, processor, position_id_func: PositionIdFunc, model_config) -> OmniSample:
    """Tokenize a chat sample (text, images, videos with or without audio track, audios) or a plain document for
    an omni model whose (thinker) config is ``model_config``; see the module docstring."""
    if isinstance(sample, TextSample):
        ids = torch.tensor(tokenize_text(sample.text, processor.tokenizer).input_ids, dtype=torch.long)
        return OmniSample(ids, ids.clone(), _position_ids(position_id_func, ids, {}, None, False))
    if not isinstance(sample, ChatSample):
        raise TypeError(f"not a sample: {type(sample).__name__}")
    media = _media(sample)
    in_video = any(media.with_track)
    tensors: dict[str, torch.Tensor] = {}
    image_grids, video_grids, seconds, audio_tokens = [], [], [], []
    if media.images:
        out = processor.image_processor(images=media.images, return_tensors="pt")
        tensors["pixel_values"], tensors["image_grid_thw"] = out["pixel_values"], out["image_grid_thw"]
        image_grids = list(out["image_grid_thw"].numpy())
    if media.videos:
        clips = [video_inputs(processor.image_processor, frames, fps) for frames, fps in media.videos]
        tensors["pixel_values_videos"] = torch.cat([c.pixel_values for c in clips])
        tensors["video_grid_thw"] = torch.tensor([c.grid_thw for c in clips], dtype=torch.long)
        tensors["video_second_per_grid"] = torch.tensor([c.seconds_per_grid for c in clips], dtype=torch.float)
        video_grids, seconds = list(tensors["video_grid_thw"].numpy()), [c.seconds_per_grid for c in clips]
    audio_lengths = None
    n_window = model_config.audio_config.n_window
    if media.audio_paths:
        extractor = processor.feature_extractor
        waves = [load_audio(p, extractor.sampling_rate) for p in media.audio_paths]
        out = extractor(
            waves,
            sampling_rate=extractor.sampling_rate,
            padding=True,
            truncation=False,
            return_attention_mask=True,
            return_tensors="pt",
        )
        tensors["input_features"] = out["input_features"]
        tensors["feature_attention_mask"] = out["attention_mask"]
        audio_lengths = out["attention_mask"].sum(-1)
        audio_tokens = [int(n) for n in omni_audio_token_counts(audio_lengths, n_window)]

    def expand(text: str) -> str:
        return processor.replace_multimodal_special_tokens(
            [text],
            iter(audio_tokens),
            iter(image_grids),
            iter(video_grids),
            video_second_per_grid=iter(seconds),
            use_audio_in_video=in_video,
            position_id_per_seconds=model_config.position_id_per_seconds,
            seconds_per_chunk=2.0,  # only read by upstream's chunked-interleave helpers, not by the expansion
        )[0]

    full, spans = assistant_spans(processor, _hf_messages(sample), expand)
    ids, offsets = encode_with_offsets(processor.tokenizer, full)
    input_ids = torch.tensor(ids, dtype=torch.long)
    token_ids = omni_token_ids(processor)
    merge = processor.image_processor.merge_size**2
    _check_count(input_ids, token_ids["image_token_id"], sum(int(g.prod()) for g in image_grids) // merge, "image")
    _check_count(input_ids, token_ids["video_token_id"], sum(int(g.prod()) for g in video_grids) // merge, "video")
    _check_count(input_ids, token_ids["audio_token_id"], sum(audio_tokens), "audio")
    labels = torch.tensor(labels_from_spans(ids, offsets, spans), dtype=torch.long)
    labels[torch.isin(input_ids, torch.tensor(list(token_ids.values())))] = IGNORE_INDEX
    position_ids = _position_ids(position_id_func, input_ids, tensors, audio_lengths, in_video)
    return OmniSample(input_ids, labels, position_ids, **tensors)

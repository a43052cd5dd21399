"""Chat samples with images and videos -> model-ready tensors for the Qwen VLMs, one sample at a time.

``tokenize_multimodal`` renders the conversation with the processor's chat template, where each image or video is a
placeholder, expands each placeholder into the right number of vision tokens, and tokenizes. Labels use the text
pipeline's prefix rendering (``assistant_spans``) with the expansion applied to every prefix, so the spans are
measured in the final text; vision tokens never carry a label. Image placeholders expand with the processor's own
``replace_image_token``; videos as in ``runtime/data/vision/video.py``.

Position ids are ``(4, L)``: row 0 the text position ``0..L-1`` (it drives the packing mask), rows 1-3 the M-RoPE
T/H/W ids from ``position_id_func``, which must give exactly the model's ``get_rope_index`` ids (the generated
models provide one: ``*ForConditionalGeneration.get_position_id_func(config)``). They are computed here, per whole
sample, because under SP the model only sees a slice of the sequence.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from runtime.data.samples import ChatSample, ImagePart, Sample, TextPart, TextSample, VideoPart
from runtime.data.sp_batch import IGNORE_INDEX
from runtime.data.text.tokenization import assistant_spans, encode_with_offsets, labels_from_spans, tokenize_text
from runtime.data.vision.processor import vlm_token_ids
from runtime.data.vision.video import (
    DEFAULT_VIDEO_FPS,
    VideoInputs,
    timestamped,
    video_inputs,
    video_placeholder_pattern,
    video_replacement,
)

# fn(input_ids (1, L), mm_token_type_ids (1, L), image_grid_thw, video_grid_thw, **extra) -> (3, 1, L)
PositionIdFunc = Callable[..., torch.Tensor]
TEXT, IMAGE, VIDEO = 0, 1, 2  # mm_token_type_ids values
VISION_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts")


@dataclass(frozen=True, eq=False)
class MultimodalSample:
    """One tokenized conversation with its vision inputs (None where the sample has no image / no video)."""

    input_ids: torch.Tensor  # (L,) long
    labels: torch.Tensor  # (L,) long, IGNORE_INDEX outside assistant replies and on every vision token
    mm_token_type_ids: torch.Tensor  # (L,) int32: 0 text, 1 image, 2 video
    position_ids: torch.Tensor  # (4, L) long: text position, then M-RoPE T/H/W
    pixel_values: torch.Tensor | None = None  # (image patches, D)
    image_grid_thw: torch.Tensor | None = None  # (images, 3) long
    pixel_values_videos: torch.Tensor | None = None  # (video patches, D)
    video_grid_thw: torch.Tensor | None = None  # (videos, 3) long
    second_per_grid_ts: torch.Tensor | None = None  # (videos,) float, Qwen2.5-VL only

    def __post_init__(self) -> None:
        length = self.input_ids.shape[-1]
        if length == 0 or self.input_ids.shape != (length,):
            raise ValueError(f"input_ids must be a non-empty 1-D tensor, got shape {tuple(self.input_ids.shape)}")
        for name in ("labels", "mm_token_type_ids"):
            if getattr(self, name).shape != (length,):
                raise ValueError(f"{name} must have shape ({length},), got {tuple(getattr(self, name).shape)}")
        if self.position_ids.shape != (4, length):
            raise ValueError(f"position_ids must have shape (4, {length}), got {tuple(self.position_ids.shape)}")
        for pixels, grid in (("pixel_values", "image_grid_thw"), ("pixel_values_videos", "video_grid_thw")):
            p, g = getattr(self, pixels), getattr(self, grid)
            if (p is None) != (g is None):
                raise ValueError(f"{pixels} and {grid} must both be set or both be None")
            if g is not None and int(g.prod(-1).sum()) != p.shape[0]:
                raise ValueError(f"{grid} covers {int(g.prod(-1).sum())} patches but {pixels} has {p.shape[0]} rows")

    def __len__(self) -> int:
        return self.input_ids.shape[0]


def load_image(path: str | Path):
    """An RGB PIL image, fully read (the file is closed); ValueError naming the file if it cannot be read."""
    from PIL import UnidentifiedImageError

    from runtime.data.images import ImageTooLarge, open_image

    try:
        with open_image(path) as image:
            return image.convert("RGB")
    except ImageTooLarge as e:
        raise ValueError(f"cannot read image {e}") from None
    except (OSError, UnidentifiedImageError) as e:
        raise ValueError(f"cannot read image {path}: {e}") from None


def _hf_messages(sample: ChatSample) -> list[dict[str, Any]]:
    """Messages as chat templates expect them; media parts become typed placeholders (the template marks them)."""
    messages = []
    for m in sample.messages:
        if isinstance(m.content, str):
            content: str | list[dict[str, str]] = m.content
        else:
            content = [
                {"type": "text", "text": p.text}
                if isinstance(p, TextPart)
                else {"type": "image" if isinstance(p, ImagePart) else "video"}
                for p in m.content
            ]
        messages.append({"role": m.role, "content": content})
    return messages


def placeholder_expander(processor, images: Sequence[str], videos: Sequence[str]) -> Callable[[str], str]:
    """``text -> text`` replacing the k-th image (video) placeholder with ``images[k]`` (``videos[k]``).

    A pure function of the text, so a prefix of a rendering expands to a prefix of the expanded whole.
    """
    image, video = re.escape(processor.image_token), video_placeholder_pattern(processor)
    pattern = re.compile(f"(?P<image>{image})|(?P<video>{video})")
    replacements = {"image": images, "video": videos}

    def expand(text: str) -> str:
        seen = {"image": 0, "video": 0}

        def replace(match: re.Match) -> str:
            kind = match.lastgroup
            k = seen[kind]
            if k >= len(replacements[kind]):
                raise ValueError(
                    f"the chat template placed more {kind} placeholders than the sample has "
                    f"{kind}s ({len(replacements[kind])})"
                )
            seen[kind] += 1
            return replacements[kind][k]

        return pattern.sub(replace, text)

    return expand


def _media(sample: ChatSample) -> tuple[list, list[tuple[list, float]]]:
    images, videos = [], []
    for message in sample.messages:
        for part in () if isinstance(message.content, str) else message.content:
            if isinstance(part, ImagePart):
                images.append(load_image(part.path))
            elif isinstance(part, VideoPart):
                videos.append(([load_image(f) for f in part.frames], part.fps or DEFAULT_VIDEO_FPS))
    return images, videos


def _vision(processor, images: list, videos: list[tuple[list, float]]) -> tuple[dict, Callable[[str], str]]:
    """The sample's vision tensors (every ``VISION_KEYS`` entry, None where absent) and its placeholder expander."""
    vision: dict[str, torch.Tensor | None] = dict.fromkeys(VISION_KEYS)
    image_texts: list[str] = []
    if images:
        image_inputs = processor.image_processor(images=images, return_tensors="pt")
        vision["pixel_values"], vision["image_grid_thw"] = image_inputs["pixel_values"], image_inputs["image_grid_thw"]
        image_texts = [processor.replace_image_token(image_inputs, image_idx=k) for k in range(len(images))]
    clips: list[VideoInputs] = [video_inputs(processor.image_processor, frames, fps) for frames, fps in videos]
    if clips:
        vision["pixel_values_videos"] = torch.cat([c.pixel_values for c in clips])
        vision["video_grid_thw"] = torch.tensor([c.grid_thw for c in clips], dtype=torch.long)
        if not timestamped(processor):
            vision["second_per_grid_ts"] = torch.tensor([c.seconds_per_grid for c in clips])
    return vision, placeholder_expander(processor, image_texts, [video_replacement(processor, c) for c in clips])


def _check_token_count(ids: torch.Tensor, token_id: int, grid: torch.Tensor | None, merge: int, what: str) -> None:
    expected = 0 if grid is None else int(grid.prod(-1).sum()) // merge**2
    found = int((ids == token_id).sum())
    if found != expected:
        raise ValueError(
            f"the tokenized sample has {found} {what} tokens but its {what}s need {expected}; does the "
            f"chat template place one placeholder per {what}?"
        )


def mrope_position_ids(
    position_id_func: PositionIdFunc,
    input_ids: torch.Tensor,
    mm_token_type_ids: torch.Tensor,
    **vision: torch.Tensor | None,
) -> torch.Tensor:
    """``(4, L)``: the text positions ``0..L-1``, then the ``(3, 1, L)`` M-RoPE ids of ``position_id_func``."""
    length = input_ids.shape[0]
    seconds = vision.get("second_per_grid_ts")
    extra = {} if seconds is None else {"second_per_grid_ts": seconds}  # qwen2_5_vl's temporal RoPE spacing
    mrope = position_id_func(
        input_ids[None], mm_token_type_ids[None], vision.get("image_grid_thw"), vision.get("video_grid_thw"), **extra
    )
    if tuple(mrope.shape) != (3, 1, length):
        raise ValueError(
            f"position_id_func must return M-RoPE ids of shape (3, 1, {length}), got {tuple(mrope.shape)}"
        )
    return torch.cat([torch.arange(length)[None], mrope[:, 0].long()])


def _tokenize_document(sample: TextSample, processor, position_id_func: PositionIdFunc) -> MultimodalSample:
    """A plain-text document in a VLM data set: tokenized as the text pipeline does, every token trained."""
    text = tokenize_text(sample.text, processor.tokenizer)
    input_ids = torch.tensor(text.input_ids, dtype=torch.long)
    mm_token_type_ids = torch.zeros(len(text), dtype=torch.int32)
    position_ids = mrope_position_ids(position_id_func, input_ids, mm_token_type_ids)
    return MultimodalSample(input_ids, input_ids.clone(), mm_token_type_ids, position_ids)


def tokenize_multimodal(sample: Sample, processor, position_id_func: PositionIdFunc) -> MultimodalSample:
    """Tokenize a chat sample (with or without images and videos) or a plain-text document for a Qwen VLM; see the
    module docstring."""
    if isinstance(sample, TextSample):
        return _tokenize_document(sample, processor, position_id_func)
    if not isinstance(sample, ChatSample):
        raise TypeError(f"not a sample: {type(sample).__name__}")
    vision, expand = _vision(processor, *_media(sample))
    full, spans = assistant_spans(processor, _hf_messages(sample), expand)
    ids, offsets = encode_with_offsets(processor.tokenizer, full)
    input_ids = torch.tensor(ids, dtype=torch.long)
    mm_token_type_ids = torch.tensor(processor.create_mm_token_type_ids([ids])[0], dtype=torch.int32)
    token_ids, merge = vlm_token_ids(processor), processor.image_processor.merge_size
    _check_token_count(input_ids, token_ids["image_token_id"], vision["image_grid_thw"], merge, "image")
    _check_token_count(input_ids, token_ids["video_token_id"], vision["video_grid_thw"], merge, "video")

    labels = torch.tensor(labels_from_spans(ids, offsets, spans), dtype=torch.long)
    markers = torch.tensor([token_ids["vision_start_token_id"], token_ids["vision_end_token_id"]])
    labels[(mm_token_type_ids != TEXT) | torch.isin(input_ids, markers)] = IGNORE_INDEX
    position_ids = mrope_position_ids(position_id_func, input_ids, mm_token_type_ids, **vision)
    return MultimodalSample(input_ids, labels, mm_token_type_ids, position_ids, **vision)

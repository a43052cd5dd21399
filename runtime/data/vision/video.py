"""A video given as its frames -> the ViT's patches and the text that stands for it in the prompt.

transformers 5.14.1's video processors need torchvision, which the CPU machines cannot have. A training video here is
already a list of frame images (no decoding, no frame sampling), so each frame goes through the processor's *image*
processor (the same resizing and normalisation as images) and the frames are then grouped ``temporal_patch_size``
at a time into the patch layout of upstream's video processors: rows ordered by temporal group, then merge window,
then position in the window; each row holds channel x frame-in-group x patch pixels. One code path on every machine,
so a data set tokenizes the same everywhere. What differs from a torchvision run of the upstream video processor:
the pixel bounds are the image processor's, applied per frame (upstream bounds frames x height x width).

The text layout is the family's: Qwen3-VL writes ``<{t:.1f} seconds>`` before each temporal group, each group in
its own vision start/end markers (as the original Qwen3-VL processor, replacing the template's whole
``<|vision_start|><|video_pad|><|vision_end|>``); Qwen2.5-VL puts all the video's tokens inside the template's
markers and gives the model ``second_per_grid_ts`` for its temporal RoPE instead.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

# When the data does not say: the rate at which Qwen's video processors sample frames by default.
DEFAULT_VIDEO_FPS = 2.0


@dataclass(frozen=True, eq=False)
class VideoInputs:
    """One video's patches ``(t*h*w, C*temporal_patch*patch**2)`` and grid ``(t, h, w)`` in patches."""

    pixel_values: torch.Tensor
    grid_thw: tuple[int, int, int]
    timestamps: tuple[float, ...]  # seconds at the middle of each temporal group (Qwen3-VL's prompt)
    seconds_per_grid: float  # seconds one temporal group spans (Qwen2.5-VL's second_per_grid_ts)


def video_inputs(image_processor, frames: Sequence, fps: float = DEFAULT_VIDEO_FPS) -> VideoInputs:
    """Patches of a video from its frames (PIL images, all the same size) via a Qwen-VL image processor."""
    if not frames:
        raise ValueError("a video needs at least one frame")
    if not fps > 0:
        raise ValueError(f"fps must be positive, got {fps}")
    out = image_processor(images=list(frames), return_tensors="pt")
    grids = out["image_grid_thw"]
    if not bool((grids == grids[0]).all()):
        raise ValueError(f"all frames of a video must have the same size; their patch grids differ: {grids.tolist()}")
    _, height, width = (int(x) for x in grids[0])
    temporal, patch = image_processor.temporal_patch_size, image_processor.patch_size
    pixels = out["pixel_values"]
    channels = pixels.shape[1] // (temporal * patch * patch)
    # The image processor repeats each frame `temporal` times; keep one copy: (frames, h*w, C, patch, patch).
    per_frame = pixels.reshape(len(frames), height * width, channels, temporal, patch, patch)[:, :, :, 0]
    indices = list(range(len(frames)))
    indices += [indices[-1]] * (-len(frames) % temporal)  # upstream pads a short last group with the last frame
    groups = len(indices) // temporal
    grouped = per_frame[indices].reshape(groups, temporal, height * width, channels, patch, patch)
    patches = grouped.permute(0, 2, 3, 1, 4, 5).reshape(groups * height * width, channels * temporal * patch * patch)
    seconds = [i / fps for i in indices]
    timestamps = tuple((seconds[g * temporal] + seconds[(g + 1) * temporal - 1]) / 2 for g in range(groups))
    return VideoInputs(patches.contiguous(), (groups, height, width), timestamps, temporal / fps)


def timestamped(processor) -> bool:
    """Whether the processor's family writes frame timestamps into the prompt (Qwen3-VL) or not (Qwen2.5-VL)."""
    return isinstance(processor, Qwen3VLProcessor)


def video_placeholder_pattern(processor) -> str:
    """Regex of the template text that one video's tokens replace (see the module docstring)."""
    pad = re.escape(processor.video_token)
    if not timestamped(processor):
        return pad
    start, end = re.escape(processor.vision_start_token), re.escape(processor.vision_end_token)
    return f"{start}{pad}{end}|{pad}"


def video_replacement(processor, video: VideoInputs) -> str:
    """The text one video's placeholder expands to: its video tokens, in the family's layout."""
    groups, height, width = video.grid_thw
    merge = processor.image_processor.merge_size
    per_group = height * width // merge**2
    if not timestamped(processor):
        return processor.video_token * (groups * per_group)
    frame = processor.vision_start_token + processor.video_token * per_group + processor.vision_end_token
    return "".join(f"<{t:.1f} seconds>{frame}" for t in video.timestamps)

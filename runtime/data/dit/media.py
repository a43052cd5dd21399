"""Reading images and videos: sizes and frame counts (cheap, for bucketing) and pixels (for the condition model).

Images and frame folders are read with PIL. Video files are decoded with PyAV (the ``av`` package on PyPI, part of
the runtime extra; its wheels bundle FFmpeg, so no system library is needed); without it, a video file is a clear
error that names the sample and says how to fix it, and frame folders keep working.

Every error is a ``MediaError`` whose message starts with the sample's ``file:line``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from runtime.data.dit.manifest import MediaSample

__all__ = ["MediaError", "MediaInfo", "load_frames", "probe", "to_pixels"]


class MediaError(ValueError):
    """A sample's media cannot be read; the message names ``file:line`` and the file."""


@dataclass(frozen=True)
class MediaInfo:
    width: int
    height: int
    frames: int  # 1 for an image


def _import_av(sample: MediaSample) -> Any:
    try:
        import av
    except ImportError:
        raise MediaError(
            f"{sample.where}: decoding the video file {sample.files[0]} needs PyAV (`pip install av`, part of "
            f"patchgen's runtime extra); or give the video as a folder of frame images"
        ) from None
    return av


def _open_image(path: Path, sample: MediaSample) -> Any:
    from runtime.data.images import ImageTooLarge, open_image

    try:
        with open_image(path) as image:
            return image.convert("RGB")
    except ImageTooLarge as exc:
        raise MediaError(f"{sample.where}: cannot read image {exc}") from None
    except Exception as exc:  # PIL raises OSError, SyntaxError, ValueError, ... for broken files
        raise MediaError(f"{sample.where}: cannot read image {path}: {exc}") from None


def _image_size(path: Path, sample: MediaSample) -> tuple[int, int]:
    from runtime.data.images import ImageTooLarge, open_image

    try:
        with open_image(path) as image:
            return image.size
    except ImageTooLarge as exc:
        raise MediaError(f"{sample.where}: cannot read image {exc}") from None
    except Exception as exc:
        raise MediaError(f"{sample.where}: cannot read image {path}: {exc}") from None


def probe(sample: MediaSample) -> MediaInfo:
    """Width, height and frame count, without decoding pixels (video files: the container's frame count, or a
    count of the decoded frames when the container does not record it)."""
    if sample.kind == "image":
        return MediaInfo(*_image_size(sample.files[0], sample), 1)
    if sample.kind == "frames":
        return MediaInfo(*_image_size(sample.files[0], sample), len(sample.files))
    av = _import_av(sample)
    path = sample.files[0]
    try:
        with av.open(str(path)) as container:
            if not container.streams.video:
                raise MediaError(f"{sample.where}: {path} has no video stream")
            stream = container.streams.video[0]
            width, height, frames = stream.codec_context.width, stream.codec_context.height, stream.frames
            if not frames:
                frames = sum(1 for _ in container.decode(stream))
    except MediaError:
        raise
    except Exception as exc:  # av.error.FFmpegError subclasses, OSError
        raise MediaError(f"{sample.where}: cannot read video {path}: {exc}") from None
    if not frames:
        raise MediaError(f"{sample.where}: {path} holds no video frames")
    return MediaInfo(width, height, frames)


def load_frames(sample: MediaSample, count: int, stride: int = 1) -> list[Any]:
    """The first ``count`` frames taken every ``stride`` frames, as RGB PIL images (one for an image sample)."""
    if sample.kind == "image":
        return [_open_image(sample.files[0], sample)]
    if sample.kind == "frames":
        chosen = sample.files[::stride][:count]
        if len(chosen) < count:
            raise MediaError(f"{sample.where}: {len(chosen)} frames at stride {stride}, {count} needed")
        return [_open_image(p, sample) for p in chosen]
    av = _import_av(sample)
    path, frames = sample.files[0], []
    try:
        with av.open(str(path)) as container:
            for index, frame in enumerate(container.decode(video=0)):
                if index % stride == 0:
                    frames.append(frame.to_image().convert("RGB"))
                    if len(frames) == count:
                        break
    except Exception as exc:
        raise MediaError(f"{sample.where}: cannot decode video {path}: {exc}") from None
    if len(frames) < count:
        raise MediaError(f"{sample.where}: {path} decoded to {len(frames)} frames at stride {stride}, {count} needed")
    return frames


def to_pixels(frames: list[Any], height: int, width: int, video: bool) -> torch.Tensor:
    """Resize each frame to cover ``height x width`` (bicubic, aspect kept), centre-crop, scale to [-1, 1].

    Returns ``(C, F, H, W)`` for a video model (an image is one frame), ``(C, H, W)`` for an image model.
    """
    from PIL import Image

    out = []
    for frame in frames:
        w, h = frame.size
        scale = max(width / w, height / h)
        size = (max(width, round(w * scale)), max(height, round(h * scale)))
        if size != (w, h):
            frame = frame.resize(size, Image.Resampling.BICUBIC)
        left, top = (size[0] - width) // 2, (size[1] - height) // 2
        frame = frame.crop((left, top, left + width, top + height))
        out.append(torch.from_numpy(np.asarray(frame, dtype=np.uint8).copy()).permute(2, 0, 1))
    pixels = torch.stack(out, dim=1).float() / 127.5 - 1.0  # (C, F, H, W)
    return pixels if video else pixels[:, 0]

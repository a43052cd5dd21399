"""Resolution / frame-count buckets: every sample is resized and cropped to one bucket's size, and a micro-batch
holds samples of one bucket only (equal latent shapes, no padding).

Buckets come from the run config's ``data.buckets``: ``[height, width]`` for image models, ``[frames, height,
width]`` for video models (an image sample of a video model is a one-frame video and needs a bucket with 1 frame).
Sizes must suit the model: ``height`` and ``width`` multiples of its ``pixel_multiple`` (VAE downsampling x patch
size: 16 for Wan, Flux and Qwen-Image); Wan's VAE compresses time by 4 after the first frame, so its frame counts
are ``4k + 1``.

A sample goes to the bucket with the most frames it can fill (at ``frame_stride``), then the closest aspect ratio,
then the largest area, then the first listed.

Limits (checked when the run config is read): at most ``MAX_BUCKETS`` buckets, sides up to ``MAX_BUCKET_SIDE``
pixels, up to ``MAX_BUCKET_FRAMES`` frames and ``MAX_BUCKET_PIXELS`` pixels per sample (frames x height x width):
every sample is decoded and resized to its bucket, so a larger one exhausts the machine instead of training, and
assigning samples to a million buckets never finishes. Real models sit far inside them (Wan: 81 x 720 x 1280 is
7.5e7 pixels).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the config check imports this module; it stays free of torch
    from runtime.data.dit.media import MediaInfo

__all__ = [
    "MAX_BUCKETS",
    "MAX_BUCKET_FRAMES",
    "MAX_BUCKET_PIXELS",
    "MAX_BUCKET_SIDE",
    "Bucket",
    "MediaRules",
    "assign_bucket",
    "check_bucket_limits",
    "parse_buckets",
]

MAX_BUCKETS = 1024
MAX_BUCKET_SIDE = 16384
MAX_BUCKET_FRAMES = 1024
MAX_BUCKET_PIXELS = 2**30


@dataclass(frozen=True)
class MediaRules:
    """What a model's condition model takes: videos or images, and the size rules."""

    video: bool
    pixel_multiple: int = 16
    temporal_multiple: int = 1  # frames = temporal_multiple * k + 1 (1: any count)


@dataclass(frozen=True, order=True)
class Bucket:
    frames: int
    height: int
    width: int

    def as_list(self, video: bool) -> list[int]:
        return [self.frames, self.height, self.width] if video else [self.height, self.width]


def _is_size(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def check_bucket_limits(raw: Any, key: str = "data.buckets") -> None:
    """ValueError naming ``key`` when ``raw`` holds more buckets, or a bucket larger, than the limits above (entries
    of the wrong shape are left to ``parse_buckets``, which knows the model's)."""
    if not isinstance(raw, list):
        return
    if len(raw) > MAX_BUCKETS:
        raise ValueError(f"{key}: {len(raw)} buckets; at most {MAX_BUCKETS} are allowed (the limit)")
    for index, entry in enumerate(raw):
        if not isinstance(entry, list) or len(entry) not in (2, 3) or not all(_is_size(v) for v in entry):
            continue
        frames, height, width = entry if len(entry) == 3 else (1, *entry)
        where = f"{key}[{index}]"
        if max(height, width) > MAX_BUCKET_SIDE:
            raise ValueError(f"{where}: {entry}: a side of more than {MAX_BUCKET_SIDE} pixels (the limit)")
        if frames > MAX_BUCKET_FRAMES:
            raise ValueError(f"{where}: {entry}: more than {MAX_BUCKET_FRAMES} frames (the limit)")
        if frames * height * width > MAX_BUCKET_PIXELS:
            raise ValueError(
                f"{where}: {entry}: {frames * height * width} pixels per sample, more than {MAX_BUCKET_PIXELS} "
                f"(2**30, the limit)"
            )


def parse_buckets(raw: Any, rules: MediaRules, key: str = "data.buckets") -> list[Bucket]:
    """``raw`` (the config value) as buckets; ValueError naming ``key`` and the bad entry."""
    shape = "[frames, height, width]" if rules.video else "[height, width]"
    if not isinstance(raw, list) or not raw:
        raise ValueError(f"{key}: expected a non-empty list of {shape} buckets, found {raw!r:.80}")
    check_bucket_limits(raw, key)
    buckets: list[Bucket] = []
    seen: set[Bucket] = set()
    for index, entry in enumerate(raw):
        where = f"{key}[{index}]"
        size = 3 if rules.video else 2
        if not isinstance(entry, list) or len(entry) != size or not all(_is_size(v) for v in entry):
            raise ValueError(f"{where}: expected {shape} as {size} positive integers, found {entry!r:.60}")
        bucket = Bucket(*entry) if rules.video else Bucket(1, *entry)
        m = rules.pixel_multiple
        if bucket.height % m or bucket.width % m:
            raise ValueError(f"{where}: height and width must be multiples of {m} for this model, found {entry}")
        if rules.temporal_multiple > 1 and (bucket.frames - 1) % rules.temporal_multiple:
            t = rules.temporal_multiple
            raise ValueError(
                f"{where}: the frame count must be {t}k + 1 (1, {t + 1}, {2 * t + 1}, ...), found {entry}"
            )
        if bucket in seen:
            raise ValueError(f"{where}: {entry} is listed twice")
        seen.add(bucket)
        buckets.append(bucket)
    return buckets


def assign_bucket(info: MediaInfo, buckets: Sequence[Bucket], frame_stride: int = 1) -> Bucket | None:
    """The bucket a sample of ``info`` goes to (see the module docstring); None when it fills none."""
    available = (info.frames - 1) // frame_stride + 1
    feasible = [b for b in buckets if b.frames <= available]
    if not feasible:
        return None
    most = max(b.frames for b in feasible)
    aspect = math.log(info.width / info.height)

    def rank(item: tuple[int, Bucket]) -> tuple[float, int, int]:
        index, b = item
        return (abs(math.log(b.width / b.height) - aspect), -b.width * b.height, index)

    return min(((i, b) for i, b in enumerate(buckets) if b in feasible and b.frames == most), key=rank)[1]

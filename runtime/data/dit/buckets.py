"""Resolution / frame-count buckets: every sample is resized and cropped to one bucket's size, and a micro-batch
holds samples of one bucket only (equal latent shapes, no padding).

Buckets come from the run config's ``data.buckets``: ``[height, width]`` for image models, ``[frames, height,
width]`` for video models (an image sample of a video model is a one-frame video and needs a bucket with 1 frame).
Sizes must suit the model: ``height`` and ``width`` multiples of its ``pixel_multiple`` (VAE downsampling x patch
size: 16 for Wan, Flux and Qwen-Image); Wan's VAE compresses time by 4 after the first frame, so its frame counts
are ``4k + 1``.

A sample goes to the bucket with the most frames it can fill (at ``frame_stride``), then the closest aspect ratio,
then the largest area, then the first listed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from runtime.data.dit.media import MediaInfo

__all__ = ["Bucket", "MediaRules", "assign_bucket", "parse_buckets"]


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


def parse_buckets(raw: Any, rules: MediaRules, key: str = "data.buckets") -> list[Bucket]:
    """``raw`` (the config value) as buckets; ValueError naming ``key`` and the bad entry."""
    shape = "[frames, height, width]" if rules.video else "[height, width]"
    if not isinstance(raw, list) or not raw:
        raise ValueError(f"{key}: expected a non-empty list of {shape} buckets, found {raw!r:.80}")
    buckets: list[Bucket] = []
    for index, entry in enumerate(raw):
        where = f"{key}[{index}]"
        size = 3 if rules.video else 2
        if (
            not isinstance(entry, list)
            or len(entry) != size
            or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in entry)
        ):
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
        if bucket in buckets:
            raise ValueError(f"{where}: {entry} is listed twice")
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

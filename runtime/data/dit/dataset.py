"""A DiT data set: the samples of a data file, each with its media facts and its bucket, and their pixels on demand.

Building it probes every sample (sizes and frame counts; see ``media.probe``), which the trainer spreads over its
ranks; ``DiTDataset.from_probed`` then assigns buckets, so a sample that fits no bucket is an error naming its
``file:line`` before anything is trained.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from runtime.data.dit.buckets import Bucket, MediaRules, assign_bucket
from runtime.data.dit.manifest import MediaSample
from runtime.data.dit.media import MediaError, MediaInfo, load_frames, to_pixels

__all__ = ["DiTDataset"]


@dataclass(frozen=True)
class DiTDataset:
    samples: tuple[MediaSample, ...]
    infos: tuple[MediaInfo, ...]
    buckets: tuple[Bucket, ...]  # each sample's bucket
    rules: MediaRules
    frame_stride: int = 1

    @classmethod
    def from_probed(
        cls,
        samples: Sequence[MediaSample],
        infos: Sequence[MediaInfo],
        buckets: Sequence[Bucket],
        rules: MediaRules,
        frame_stride: int = 1,
    ) -> DiTDataset:
        """Assign each sample its bucket; ``MediaError`` (naming ``file:line``) for one that fits none."""
        assigned = []
        for sample, info in zip(samples, infos, strict=True):
            if sample.is_video and not rules.video:
                raise MediaError(f"{sample.where}: this model trains on images; the line gives a video")
            bucket = assign_bucket(info, buckets, frame_stride)
            if bucket is None:
                fewest = min(b.frames for b in buckets)
                available = (info.frames - 1) // frame_stride + 1
                raise MediaError(
                    f"{sample.where}: {available} frame(s) at frame_stride {frame_stride}, but every bucket in "
                    f"data.buckets needs at least {fewest}; add a shorter bucket or remove the line"
                )
            assigned.append(bucket)
        return cls(tuple(samples), tuple(infos), tuple(assigned), rules, frame_stride)

    def __len__(self) -> int:
        return len(self.samples)

    def pixels(self, index: int) -> torch.Tensor:
        """Sample ``index`` resized and cropped to its bucket, in [-1, 1]: ``(C, F, H, W)`` or ``(C, H, W)``."""
        sample, bucket = self.samples[index], self.buckets[index]
        frames = load_frames(sample, bucket.frames, self.frame_stride)
        return to_pixels(frames, bucket.height, bucket.width, self.rules.video)

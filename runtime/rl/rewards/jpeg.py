"""JPEG (in)compressibility: how many kilobytes a sample takes as a quality-95 JPEG (DDPO's toy rewards, kept by
flow_grpo and verl-omni under these names).

* ``jpeg_incompressibility``: ``+ size_kB`` (``size_bytes / 1000``): rewards detail and noise.
* ``jpeg_compressibility``: ``- size_kB * scale``, ``scale`` 1/500 by default (flow_grpo's and verl-omni's
  ``-rew / 500``, which keeps the reward near [-1, 0] for 512 px images); ``scale: 1`` is DDPO's ``-rew``.

Samples are encoded as the 8-bit RGB images a pipeline outputs (``to_uint8``: pixels in [-1, 1] -> round((x + 1) *
127.5)), with Pillow's default chroma subsampling, as the peers do. A video's frames are encoded one by one and the
sizes averaged (the peers define the reward for images only).
"""

from __future__ import annotations

import io
from collections.abc import Sequence

import PIL.Image
import torch

__all__ = ["JPEG_KINDS", "JpegSizeReward", "jpeg_kilobytes"]

JPEG_KINDS = ("jpeg_compressibility", "jpeg_incompressibility")
QUALITY = 95  # the peers' fixed quality


def jpeg_kilobytes(pixels: torch.Tensor) -> float:
    """Size in kB (1000 bytes) of one ``(3, H, W)`` image in [-1, 1] saved as a quality-95 JPEG."""
    from runtime.rl.rewards.http import to_uint8

    buffer = io.BytesIO()
    PIL.Image.fromarray(to_uint8(pixels)).save(buffer, format="JPEG", quality=QUALITY)
    return buffer.tell() / 1000


class JpegSizeReward:
    """``sign * scale * size_kB`` per sample: ``sign`` -1 for compressibility, +1 for incompressibility."""

    def __init__(self, kind: str, scale: float | None = None) -> None:
        if kind not in JPEG_KINDS:
            raise ValueError(f"unknown JPEG reward {kind!r}; expected one of {JPEG_KINDS}")
        self.sign = -1.0 if kind == "jpeg_compressibility" else 1.0
        self.scale = (1 / 500 if kind == "jpeg_compressibility" else 1.0) if scale is None else float(scale)

    def __call__(self, samples: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        frames = samples.unbind(2) if samples.ndim == 5 else (samples,)
        sizes = torch.tensor([[jpeg_kilobytes(x) for x in frame] for frame in frames], dtype=torch.float64)
        return (self.sign * self.scale * sizes.mean(dim=0)).float()

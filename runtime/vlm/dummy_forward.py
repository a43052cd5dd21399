"""FSDP dummy forward of the vision tower for ranks whose batch holds no image (or no video).

FSDP2 all-gathers a block's parameters when the block runs and reduce-scatters its gradients in backward; these are
collectives, so every rank of the mesh must run the same blocks the same number of times. A VLM calls its vision
tower once per modality present in the batch, so a rank with a text-only batch would skip calls the others make and
the job would hang. Under a multi-rank layout the generated models therefore run the tower on one tiny all-zero image
(one merge unit of patches) for each absent modality and add ``0 * sum(outputs)`` to the input embeddings: the
forward value is unchanged, every vision parameter gets an exact-zero gradient, and every rank runs the same
collectives. Single-process runs skip it, so the generated model stays bitwise equal to upstream.

All ranks of an SP group see the same images (the collator gives each the whole sample's pixels), so they agree on
whether to run it, and the ViT's SP hooks pad the dummy like any other image.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor

from runtime.parallel.state import get_parallel_state

__all__ = ["dummy_vision_inputs", "needs_dummy_forward", "towers_uniform", "vision_dummy_forward"]

_UNIFORM = [False]  # inside ``towers_uniform``: every rank's batch holds the same media


def needs_dummy_forward() -> bool:
    """Whether this process runs in a multi-rank layout, where skipping the vision tower would desync collectives
    (not inside ``towers_uniform``)."""
    return get_parallel_state().world_size > 1 and not _UNIFORM[0]


@contextmanager
def towers_uniform() -> Iterator[None]:
    """No dummy tower passes (vision and audio) within: for a caller that knows every rank's batch holds the same
    media and that computes without gradients (the self-check's first look at a planted defect), where every rank
    then runs the same tower passes without them and the dummies' exact-zero terms leave each value bitwise as it
    is. Training never enters it: a rank's batch is its own, and backward needs every tower's zero gradients."""
    _UNIFORM[0] = True
    try:
        yield
    finally:
        _UNIFORM[0] = False


def dummy_vision_inputs(vision_config: Any, device: torch.device, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """(pixel_values, grid_thw) of one all-zero image of a single merge unit: ``merge**2`` flattened patches."""
    merge = vision_config.spatial_merge_size
    patch_dim = vision_config.in_channels * vision_config.temporal_patch_size * vision_config.patch_size**2
    pixels = torch.zeros(merge * merge, patch_dim, device=device, dtype=dtype)
    grid = torch.tensor([[1, merge, merge]], device=device, dtype=torch.long)
    return pixels, grid


def _floating_tensors(value: Any) -> Iterator[Tensor]:
    if isinstance(value, Tensor):
        if value.is_floating_point():
            yield value
    elif isinstance(value, dict):  # ModelOutput is a dict
        for item in value.values():
            yield from _floating_tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _floating_tensors(item)


def vision_dummy_forward(
    inputs_embeds: Tensor, pixel_values: Tensor | None, get_features: Callable[..., Any], vision_config: Any
) -> Tensor:
    """``inputs_embeds`` plus an exact-zero term that runs the vision tower (``get_features``, the model's
    ``get_image_features`` / ``get_video_features``) on a dummy image, when ``pixel_values`` is None in a
    multi-rank layout; otherwise ``inputs_embeds`` itself."""
    if pixel_values is not None or not needs_dummy_forward():
        return inputs_embeds
    pixels, grid = dummy_vision_inputs(vision_config, inputs_embeds.device, inputs_embeds.dtype)
    outputs = get_features(pixels, grid)
    zero = sum(t.sum() for t in _floating_tensors(outputs)) * 0.0
    return inputs_embeds + zero.to(inputs_embeds.dtype)

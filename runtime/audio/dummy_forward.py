"""FSDP dummy forward of the audio encoder for ranks whose batch holds no audio.

The audio counterpart of ``runtime.vlm.dummy_forward``: under a multi-rank layout FSDP2 all-gathers the encoder's
parameters when it runs and reduce-scatters their gradients in backward, so a rank with a text-only (or vision-only)
batch must still run it. It runs the encoder on one short all-zero mel input and adds ``0 * sum(outputs)`` to the
input embeddings: values unchanged, every audio parameter gets an exact-zero gradient, collectives in step. A single
process never runs it (bitwise parity with upstream).

The dummy's dtype is read from the encoder's parameters at call time, not fixed when the model is built: under
FSDP2 mixed precision the parameters a module computes with are not the ones it was built with, and the rank must
feed the same dtype a real batch would reach the encoder with.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from runtime.vlm.dummy_forward import _floating_tensors, needs_dummy_forward

__all__ = ["audio_dummy_forward", "dummy_audio_inputs", "live_dtype"]


def live_dtype(module: nn.Module) -> torch.dtype:
    """The dtype of ``module``'s first floating-point parameter, read now."""
    for param in module.parameters():
        if param.is_floating_point():
            return param.dtype
    raise ValueError(f"{type(module).__name__} has no floating-point parameter to take a dtype from")


def dummy_audio_inputs(
    num_mel_bins: int, frames: int, device: torch.device, dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """``(input_features (1, mel, frames), feature_attention_mask (1, frames))`` of one all-zero audio."""
    if frames < 1:
        raise ValueError(f"a dummy audio needs at least one frame, got {frames}")
    features = torch.zeros(1, num_mel_bins, frames, device=device, dtype=dtype)
    mask = torch.ones(1, frames, device=device, dtype=torch.long)
    return features, mask


def audio_dummy_forward(
    inputs_embeds: Tensor,
    input_features: Tensor | None,
    get_features: Callable[..., Any],
    audio_config: Any,
    tower: nn.Module,
    frames: int = 100,
) -> Tensor:
    """``inputs_embeds`` plus an exact-zero term that runs the audio encoder (``get_features(features, mask)``, the
    model's ``get_audio_features``) on a dummy audio of ``frames`` mel frames, when ``input_features`` is None in a
    multi-rank layout; otherwise ``inputs_embeds`` itself."""
    if input_features is not None or not needs_dummy_forward():
        return inputs_embeds
    features, mask = dummy_audio_inputs(audio_config.num_mel_bins, frames, inputs_embeds.device, live_dtype(tower))
    outputs = get_features(features, mask)
    zero = sum(t.sum() for t in _floating_tensors(outputs)) * 0.0
    return inputs_embeds + zero.to(inputs_embeds.dtype)

"""Shared pieces of the VLM parity tests: paired models with equal weights and a two-image batch."""

from __future__ import annotations

import torch

from runtime.models.registry import lookup
from runtime.models.tiny_configs import random_vlm_batch, tiny_config

# Two images in one row: 4x6 and 2x4 patches (6 and 2 LM tokens after the 2x2 merge), text around them.
GRIDS = ((1, 4, 6), (1, 2, 4))
TEXT = (5, 7, 4)


def vlm_models(model_type: str, seed: int = 0, **config_overrides):
    """(upstream, generated) with identical weights, fp32, sdpa."""
    config = tiny_config(model_type, **config_overrides)
    entry = lookup(model_type)
    torch.manual_seed(seed)
    upstream = entry.upstream_auto_class().from_config(config, attn_implementation="sdpa")
    generated = entry.causal_lm_class()(config)
    generated.load_state_dict(upstream.state_dict())
    return upstream, generated


def vlm_batch(model_type: str, grids=GRIDS, text=TEXT, seed: int = 1, videos=()) -> dict[str, torch.Tensor]:
    return random_vlm_batch(grids, text, tiny_config(model_type), seed, videos)
